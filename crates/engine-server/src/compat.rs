//! The endpoints other routers probe, so that any router can front a simulated engine:
//! SGLang's (`/server_info`, `/model_info`, their `/get_*` forms, `/health_generate`), vLLM's
//! (`/version`, `/load`, `/detokenize`, `/kv_event_sources`). Their shapes follow the engines'
//! public API docs; each carries what routers read (the served model's name above all: a
//! router that cannot learn it files the worker under "unknown" and refuses requests that name
//! the model).

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use protocol::ApiError;
use protocol::http::{check_model, json_response, read_json_within};
use serde::Deserialize;
use serde_json::json;

use crate::http::AppState;

/// The version every probe reports: kvroute's own, so a router's logs tell a simulated worker
/// from a real one.
const VERSION: &str = concat!("kvroute-", env!("CARGO_PKG_VERSION"));

pub fn routes(router: Router<Arc<AppState>>) -> Router<Arc<AppState>> {
    router
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/health_generate", get(health_generate))
        .route("/version", get(version))
        .route("/load", get(load))
        .route("/detokenize", post(detokenize))
        .route("/kv_event_sources", get(kv_event_sources))
}

/// SGLang's server arguments, as far as a simulated engine has them, with the fields
/// vllm-router reads from the same endpoint. Routers take the model's name from `model_id` or
/// the last segment of `model_path`, the KV block size from `kv_block_size`, and tell
/// restarts apart by `instance_id`.
async fn server_info(State(state): State<Arc<AppState>>) -> Response {
    let card = &state.info;
    let block_size = card.block_size.unwrap_or(0);
    json_response(
        200,
        &json!({
            "model_path": card.model,
            "model_id": card.model,
            "served_model_name": card.model,
            "instance_id": format!("{:016x}", card.instance),
            "tokenizer_path": state.assets.tokenizer.name(),
            "version": VERSION,
            "dp_size": 1,
            "tp_size": 1,
            "page_size": block_size,
            "kv_block_size": block_size,
            "context_length": card.max_model_len,
            "max_running_requests": card.limits.max_num_seqs,
            "max_total_num_tokens": card
                .limits
                .kv_capacity_blocks
                .map(|blocks| blocks * u64::from(block_size)),
            "enable_prefix_caching": true,
            "kv_events_endpoint": card.zmq_endpoint,
        }),
    )
}

/// SGLang's model info.
async fn model_info(State(state): State<Arc<AppState>>) -> Response {
    json_response(
        200,
        &json!({
            "model_path": state.info.model,
            "served_model_name": state.info.model,
            "tokenizer_path": state.assets.tokenizer.name(),
            "is_generation": true,
            "weight_version": "default",
            "max_context_length": state.info.max_model_len,
        }),
    )
}

/// SGLang runs a one-token generation here; the simulated engine is healthy exactly when
/// its scheduler task runs, which is what `/health` checks.
async fn health_generate(State(state): State<Arc<AppState>>) -> Response {
    if state.commands.is_closed() {
        ApiError::service_unavailable("the engine stopped").into_response()
    } else {
        json_response(200, &json!({}))
    }
}

async fn version() -> Response {
    json_response(200, &json!({ "version": VERSION }))
}

/// vLLM's `/load` (its `--enable-server-load-tracking`): requests in the engine, running or
/// waiting, as of the scheduler's last snapshot.
async fn load(State(state): State<Arc<AppState>>) -> Response {
    let in_engine = state
        .snapshot
        .lock()
        .map(|s| s.metrics.running + s.metrics.waiting)
        .unwrap_or_default();
    json_response(200, &json!({ "server_load": in_engine }))
}

/// `POST /detokenize` as vLLM takes it: `{"tokens": [...]}` gives `{"prompt": "..."}`.
#[derive(Deserialize)]
struct DetokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    tokens: Vec<u32>,
}

async fn detokenize(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let result = async {
        let request: DetokenizeRequest =
            read_json_within(&headers, body, state.body_limit, state.body_timeout).await?;
        if let Some(model) = &request.model {
            check_model(&state.info.model, model)?;
        }
        let prompt = state
            .assets
            .tokenizer
            .decode(&request.tokens)
            .map_err(|e| {
                ApiError::invalid_param(
                    "tokens",
                    format!("not a sequence of this vocabulary's tokens: {e}"),
                )
            })?;
        Ok::<_, ApiError>(json_response(200, &json!({ "prompt": prompt })))
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// KV-event discovery as vllm-router reads it: an object keyed by data-parallel rank, each
/// entry vLLM's `KVEventsConfig` (`endpoint`, `replay_endpoint`, `topic`, `publisher`), empty
/// when the server publishes no ZMQ events. vllm-router's `kv_aware` policy subscribes to what
/// it lists.
async fn kv_event_sources(State(state): State<Arc<AppState>>) -> Response {
    let sources: serde_json::Map<String, serde_json::Value> = state
        .info
        .zmq_endpoint
        .iter()
        .map(|endpoint| {
            (
                "0".to_string(),
                json!({
                    "endpoint": endpoint,
                    "replay_endpoint": null,
                    "topic": "",
                    "publisher": "zmq",
                    "enable_kv_cache_events": true,
                }),
            )
        })
        .collect();
    json_response(200, &sources)
}
