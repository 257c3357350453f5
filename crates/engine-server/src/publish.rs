//! KV event publishing (NATS in our format, ZMQ in vLLM's) and NATS worker registration.
//!
//! The engine's events already carry what both formats need (block hashes, parents and
//! token ids), so publishing is a conversion to the wire, in order. Like vLLM's
//! `ZmqEventPublisher`, the ZMQ publisher can keep its last batches in a bounded ring
//! ([`protocol::vllm::ReplayBuffer`], vLLM's `buffer_steps`) and answer replay requests on a
//! ROUTER socket (vLLM's `replay_endpoint`), so a subscriber that missed batches asks for
//! them instead of dropping what it knew.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::StreamExt;
use kv_index::CacheMirror;
use kv_index::{KvEvent, WorkerId};
use protocol::nats_client::NatsSecurity;
use protocol::vllm::{
    EventEncoding, ReplayBuffer, VllmEvent, VllmEventBatch, decode_replay_request,
    encode_multipart, encode_replay_end, encode_replay_frame,
};
use protocol::{KvEventBatch, KvStateRequest, Subjects, WorkerAnnounce, WorkerMessage};
use tokio::sync::{mpsc, watch};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// One `GET /kv_state` waiting for the publisher: it answers between batches, with the
/// encoded [`protocol::ZmqKvState`] or why there is none.
pub type ZmqStateRequest = tokio::sync::oneshot::Sender<Result<Vec<u8>, String>>;

/// `GET /kv_state` requests the publisher holds at once; more are refused (503) at once.
pub const ZMQ_STATE_QUEUE: usize = 4;

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(transparent)]
    NatsConnect(protocol::nats_client::NatsConnectError),
    #[error(transparent)]
    Namespace(#[from] protocol::BadNamespace),
    #[error("cannot bind the ZMQ publisher (or its replay socket) on {endpoint}: {source}")]
    ZmqBind {
        endpoint: String,
        source: zeromq::ZmqError,
    },
    #[error("the worker's NATS announcement cannot be encoded: {0}")]
    Announcement(#[from] serde_json::Error),
}

/// A connected NATS publisher.
#[derive(Clone)]
pub struct Nats {
    pub client: async_nats::Client,
    pub subjects: Subjects,
    /// The connection's state since, for `/health`.
    pub status: protocol::nats_client::NatsStatus,
}

impl Nats {
    pub async fn connect(
        url: &str,
        security: &NatsSecurity,
        namespace: &str,
    ) -> Result<Nats, PublishError> {
        let subjects = Subjects::new(namespace)?;
        let (client, status) =
            protocol::nats_client::connect_with_status(url, security, Duration::from_secs(5))
                .await
                .map_err(PublishError::NatsConnect)?;
        Ok(Nats {
            client,
            subjects,
            status,
        })
    }
}

/// A bound ZMQ PUB socket, and its replay socket when asked for.
pub struct Zmq {
    socket: zeromq::PubSocket,
    encoding: EventEncoding,
    /// The resolved endpoint (`tcp://127.0.0.1:PORT`).
    pub endpoint: String,
    replay: Option<Replay>,
}

/// The replay side: a ROUTER socket and the last batches sent.
struct Replay {
    socket: zeromq::RouterSocket,
    endpoint: String,
    buffer: ReplayBuffer,
}

async fn bind_socket<S: Socket>(socket: &mut S, endpoint: &str) -> Result<String, PublishError> {
    socket
        .bind(endpoint)
        .await
        .map(|bound| bound.to_string())
        .map_err(|source| PublishError::ZmqBind {
            endpoint: endpoint.to_string(),
            source,
        })
}

impl Zmq {
    /// Binds the PUB socket on `endpoint`, and with `replay` a ROUTER on `replay.0` that
    /// replays the last `replay.1` batches.
    pub async fn bind(
        endpoint: &str,
        encoding: EventEncoding,
        replay: Option<(&str, usize)>,
    ) -> Result<Zmq, PublishError> {
        let mut socket = zeromq::PubSocket::new();
        let endpoint = bind_socket(&mut socket, endpoint).await?;
        let replay = match replay {
            Some((replay_endpoint, capacity)) => {
                let mut socket = zeromq::RouterSocket::new();
                let endpoint = bind_socket(&mut socket, replay_endpoint).await?;
                Some(Replay {
                    socket,
                    endpoint,
                    buffer: ReplayBuffer::new(capacity),
                })
            }
            None => None,
        };
        Ok(Zmq {
            socket,
            encoding,
            endpoint,
            replay,
        })
    }

    /// The resolved replay endpoint, when replay is on.
    pub fn replay_endpoint(&self) -> Option<String> {
        self.replay.as_ref().map(|r| r.endpoint.clone())
    }
}

/// Waits for the next replay request (forever without a replay socket).
async fn next_replay_request(zmq: &mut Option<Zmq>) -> zeromq::ZmqResult<ZmqMessage> {
    match zmq.as_mut().and_then(|z| z.replay.as_mut()) {
        Some(replay) => replay.socket.recv().await,
        None => std::future::pending().await,
    }
}

/// Answers one replay request: every buffered batch from the asked number on, then the end
/// marker, as vLLM's `_service_replay` does. A malformed request is logged and dropped.
async fn serve_replay(replay: &mut Replay, request: ZmqMessage) {
    let (identity, start) = match decode_replay_request(&request.into_vec()) {
        Ok(request) => request,
        Err(err) => {
            tracing::warn!(%err, "malformed KV event replay request; ignored");
            return;
        }
    };
    let mut replies: Vec<[Vec<u8>; 4]> = replay
        .buffer
        .since(start)
        .map(|(seq, payload)| encode_replay_frame(&identity, seq, payload))
        .collect();
    replies.push(encode_replay_end(&identity));
    for parts in replies {
        let frames: Vec<Bytes> = parts.into_iter().map(Bytes::from).collect();
        let Ok(message) = ZmqMessage::try_from(frames) else {
            continue;
        };
        if let Err(err) = replay.socket.send(message).await {
            // The subscriber left; it will see the gap again and ask again, or resync.
            tracing::debug!(%err, "KV event replay send failed");
            return;
        }
    }
}

fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Publishes each batch of KV events the engine task produces, in order, until the channel
/// closes.
pub async fn run_kv_publisher(
    mut batches: mpsc::Receiver<Vec<KvEvent>>,
    worker: WorkerId,
    instance: u64,
    block_size: u32,
    nats: Option<Nats>,
    mut zmq: Option<Zmq>,
    mut zmq_state_requests: mpsc::Receiver<ZmqStateRequest>,
) {
    let mut zmq_seq: u64 = 0;
    let subject = nats.as_ref().map(|n| n.subjects.kv_events(worker));
    // What the published stream says this worker caches, for gateways that subscribe late.
    let mut mirror = CacheMirror::default();
    let mut state_requests = match &nats {
        Some(n) => match n.client.subscribe(n.subjects.kv_state(worker)).await {
            Ok(requests) => Some(requests),
            Err(err) => {
                tracing::warn!(%err, "cannot take cache-state requests over NATS; a gateway that starts later learns this worker's cache from new events only");
                None
            }
        },
        None => None,
    };
    loop {
        let events = tokio::select! {
            events = batches.recv() => match events {
                Some(events) => events,
                None => break,
            },
            request = next_state_request(&mut state_requests) => {
                match (request, &nats) {
                    (Some(request), Some(nats)) => answer_state_request(nats, worker, instance, &mirror, request).await,
                    (None, _) => state_requests = None,
                    (Some(_), None) => {}
                }
                continue;
            }
            Some(answer) = zmq_state_requests.recv(), if zmq.is_some() => {
                let _ = answer.send(zmq_state(worker, instance, zmq_seq, &mirror));
                continue;
            }
            request = next_replay_request(&mut zmq) => {
                match (request, zmq.as_mut().and_then(|z| z.replay.as_mut())) {
                    (Ok(request), Some(replay)) => serve_replay(replay, request).await,
                    (Err(err), _) => tracing::debug!(%err, "KV event replay receive failed"),
                    (Ok(_), None) => {}
                }
                continue;
            }
        };
        if nats.is_some() || zmq.is_some() {
            mirror.apply(&events);
        }
        if let (Some(nats), Some(subject)) = (&nats, &subject) {
            match KvEventBatch::from_events(worker, instance, &events) {
                Ok(batch) => {
                    if let Err(err) = nats
                        .client
                        .publish(subject.clone(), Bytes::from(batch.encode()))
                        .await
                    {
                        tracing::warn!(%err, "publishing KV events to NATS failed; receivers will see a sequence gap");
                    }
                }
                Err(err) => tracing::error!(%err, "KV event batch not encodable"),
            }
        }
        if let Some(zmq) = &mut zmq {
            let mut vllm_events = Vec::with_capacity(events.len());
            for event in &events {
                match VllmEvent::from_kv_event(event, block_size) {
                    Ok(e) => vllm_events.push(e),
                    Err(err) => tracing::warn!(%err, "KV event left out of the vLLM stream"),
                }
            }
            let batch = VllmEventBatch {
                ts: unix_seconds(),
                events: vllm_events,
                data_parallel_rank: Some(0),
            };
            let parts = encode_multipart(b"", zmq_seq, &batch, zmq.encoding);
            if let Some(replay) = &mut zmq.replay {
                replay.buffer.push(zmq_seq, parts[2].clone());
            }
            zmq_seq += 1;
            let frames: Vec<Bytes> = parts.into_iter().map(Bytes::from).collect();
            if let Ok(message) = ZmqMessage::try_from(frames) {
                if let Err(err) = zmq.socket.send(message).await {
                    tracing::warn!(%err, "publishing KV events over ZMQ failed");
                }
            }
        }
    }
}

/// The answer to `GET /kv_state`: the mirror, which covers every ZMQ batch before
/// `next_batch` (it is asked between batches).
fn zmq_state(
    worker: WorkerId,
    instance: u64,
    next_batch: u64,
    mirror: &CacheMirror,
) -> Result<Vec<u8>, String> {
    let snapshot = mirror
        .snapshot()
        .ok_or("this worker's cache passed the snapshot bound")?;
    let parts = protocol::state_parts(worker, instance, mirror.next_seq(), &snapshot);
    Ok(protocol::ZmqKvState { next_batch, parts }.encode())
}

/// The next cache-state request, or never when not taking them.
async fn next_state_request(
    requests: &mut Option<async_nats::Subscriber>,
) -> Option<async_nats::Message> {
    match requests {
        Some(requests) => requests.next().await,
        None => std::future::pending().await,
    }
}

/// Answers a gateway's cache-state request with the mirror, in parts, on its reply subject.
/// Called between batches, so the snapshot is exactly the stream up to its `next_seq`.
async fn answer_state_request(
    nats: &Nats,
    worker: WorkerId,
    instance: u64,
    mirror: &CacheMirror,
    request: async_nats::Message,
) {
    let Some(reply) = request.reply else {
        return;
    };
    match KvStateRequest::decode(&request.payload) {
        Ok(r) if r.worker == worker.0 => {}
        Ok(r) => {
            tracing::debug!(
                asked = r.worker,
                "cache-state request for another worker; ignored"
            );
            return;
        }
        Err(err) => {
            tracing::debug!(%err, "undecodable cache-state request; ignored");
            return;
        }
    }
    let Some(snapshot) = mirror.snapshot() else {
        tracing::warn!(
            "cache-state request not answered: this worker's cache passed the snapshot bound"
        );
        return;
    };
    for part in protocol::state_parts(worker, instance, mirror.next_seq(), &snapshot) {
        if let Err(err) = nats
            .client
            .publish(reply.clone(), Bytes::from(part.encode()))
            .await
        {
            tracing::warn!(%err, "answering a cache-state request failed");
            return;
        }
    }
    tracing::debug!(blocks = mirror.len(), "answered a cache-state request");
}

/// A worker's announcement and goodbye, encoded once, before anything is published.
pub struct Registration {
    hello: Bytes,
    goodbye: Bytes,
    /// Heartbeats go out three times per lease.
    period: Duration,
}

impl Registration {
    pub fn new(announce: WorkerAnnounce) -> Result<Registration, PublishError> {
        let period = Duration::from_millis((announce.lease_ms / 3).max(1));
        let instance = announce.card.instance;
        let token = announce.token.clone();
        let hello = WorkerMessage::Announce(announce);
        let goodbye = WorkerMessage::Goodbye {
            worker: hello.worker().0,
            instance,
            token,
        };
        Ok(Registration {
            hello: Bytes::from(hello.encode()?),
            goodbye: Bytes::from(goodbye.encode()?),
            period,
        })
    }
}

/// Announces the worker now and every `lease / 3` until shutdown, then says goodbye.
pub async fn run_registration(
    nats: Nats,
    registration: Registration,
    mut shutdown: watch::Receiver<bool>,
) {
    let subject = nats.subjects.workers();
    loop {
        if let Err(err) = nats
            .client
            .publish(subject.clone(), registration.hello.clone())
            .await
        {
            tracing::warn!(%err, "announcing the worker on NATS failed");
        }
        tokio::select! {
            _ = tokio::time::sleep(registration.period) => {}
            _ = shutdown.wait_for(|stop| *stop) => break,
        }
    }
    if let Err(err) = nats.client.publish(subject, registration.goodbye).await {
        tracing::warn!(%err, "saying goodbye on NATS failed");
    }
    let _ = nats.client.flush().await;
}
