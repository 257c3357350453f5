//! KV event publishing (NATS in our format, ZMQ in vLLM's) and NATS worker registration.
//!
//! The engine's events already carry what both formats need (block hashes, parents and
//! token ids), so publishing is a conversion to the wire, in order.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kv_index::{KvEvent, WorkerId};
use protocol::vllm::{EventEncoding, VllmEvent, VllmEventBatch, encode_multipart};
use protocol::{KvEventBatch, Subjects, WorkerAnnounce, WorkerMessage};
use tokio::sync::{mpsc, watch};
use zeromq::{Socket, SocketSend, ZmqMessage};

/// Why a publisher could not start.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error("cannot connect to NATS at {url}: {source} (is nats-server running?)")]
    NatsConnect {
        url: String,
        source: async_nats::ConnectError,
    },
    #[error(transparent)]
    Namespace(#[from] protocol::BadNamespace),
    #[error("cannot bind the ZMQ publisher on {endpoint}: {source}")]
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
}

impl Nats {
    pub async fn connect(url: &str, namespace: &str) -> Result<Nats, PublishError> {
        let subjects = Subjects::new(namespace)?;
        let client =
            async_nats::connect(url)
                .await
                .map_err(|source| PublishError::NatsConnect {
                    url: url.to_string(),
                    source,
                })?;
        Ok(Nats { client, subjects })
    }
}

/// A bound ZMQ PUB socket.
pub struct Zmq {
    socket: zeromq::PubSocket,
    encoding: EventEncoding,
    /// The resolved endpoint (`tcp://127.0.0.1:PORT`).
    pub endpoint: String,
}

impl Zmq {
    pub async fn bind(endpoint: &str, encoding: EventEncoding) -> Result<Zmq, PublishError> {
        let mut socket = zeromq::PubSocket::new();
        let bound = socket
            .bind(endpoint)
            .await
            .map_err(|source| PublishError::ZmqBind {
                endpoint: endpoint.to_string(),
                source,
            })?;
        Ok(Zmq {
            socket,
            encoding,
            endpoint: bound.to_string(),
        })
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
) {
    let mut zmq_seq: u64 = 0;
    let subject = nats.as_ref().map(|n| n.subjects.kv_events(worker));
    while let Some(events) = batches.recv().await {
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
