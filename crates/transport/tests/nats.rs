//! The JetStream transport against the real NATS server on this machine (127.0.0.1:4222, or
//! `TIDEMARK_TEST_NATS`): skipped, with the reason printed, when none answers.

use std::time::Duration;

use async_nats::jetstream;
use serde_json::json;
use tidemark_core::store::ReceiveOutcome;
use tidemark_core::Envelope;
use tidemark_transport::{connect, nats_subject, TransportConfig};

fn server() -> String {
    std::env::var("TIDEMARK_TEST_NATS").unwrap_or_else(|_| "127.0.0.1:4222".to_string())
}

async fn jetstream_or_skip() -> Option<jetstream::Context> {
    let connected =
        async_nats::ConnectOptions::new().connection_timeout(Duration::from_secs(2)).connect(server()).await;
    match connected {
        Ok(client) => Some(jetstream::new(client)),
        Err(e) => {
            println!("skipped: NATS not reachable at {}: {e}", server());
            None
        }
    }
}

fn envelope(flow: &str, seq: i64) -> Envelope {
    Envelope {
        event_id: format!("{flow}-{seq}-{}", std::process::id()),
        source: "shop.eu".into(),
        generation: "g1".into(),
        flow_id: flow.into(),
        seq,
        event_type: "parcel.noted".into(),
        schema_version: 1,
        payload: json!({"seq": seq}),
        created_at_ms: 1,
        traceparent: None,
    }
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("{prefix}{}x{nanos}", std::process::id())
}

#[tokio::test]
async fn jetstream_publishes_are_acked_once_and_answered_duplicate_after() {
    let Some(js) = jetstream_or_skip().await else { return };
    let prefix = unique("tmktest");
    let mut stream = js
        .create_stream(jetstream::stream::Config {
            name: prefix.to_uppercase(),
            subjects: vec![format!("{prefix}.>")],
            ..Default::default()
        })
        .await
        .expect("create the stream");
    let transport = connect(&format!("nats://{}/{prefix}", server()), &TransportConfig::default()).unwrap();
    let items: Vec<(String, Envelope)> =
        [("order.7", 1), ("order.7", 2), ("order-8", 1), ("order.7", 3), ("order-8", 2)]
            .into_iter()
            .map(|(flow, seq)| ("audit".to_string(), envelope(flow, seq)))
            .collect();

    let first = transport.deliver(&items).await.expect("published");
    assert!(first.iter().all(|o| matches!(o, ReceiveOutcome::Accepted { .. })), "{first:?}");
    let again = transport.deliver(&items).await.expect("published again");
    assert!(again.iter().all(|o| matches!(o, ReceiveOutcome::Duplicate { .. })), "{again:?}");
    assert_eq!(stream.info().await.unwrap().state.messages, 5, "stored once each");

    // In order, on the documented subjects, with the envelope and its headers.
    for (i, (_, sent)) in items.iter().enumerate() {
        let message = stream.get_raw_message(i as u64 + 1).await.expect("stored message");
        assert_eq!(message.subject.as_str(), nats_subject(&prefix, sent));
        let stored: Envelope = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(&stored, sent);
        let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_string());
        let id = message.headers.get(async_nats::header::NATS_MESSAGE_ID).map(|v| v.as_str().to_string());
        assert_eq!(id, Some(sent.event_id.clone()));
        assert_eq!(header("Tidemark-Seq"), Some(sent.seq.to_string()));
        assert_eq!(header("Tidemark-Content-Hash"), Some(sent.content_hash()));
    }
    assert_eq!(nats_subject(&prefix, &items[0].1), format!("{prefix}.shop_eu.order_7"));

    // No stream captures this prefix: no PubAck, a failed delivery, never an `accepted`.
    let nowhere =
        connect(&format!("nats://{}/{}", server(), unique("tmknowhere")), &TransportConfig::default()).unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(30), nowhere.deliver(&items[..1])).await.expect("answers");
    assert!(refused.is_err(), "{refused:?}");
    js.delete_stream(prefix.to_uppercase()).await.expect("delete the stream");
}

#[tokio::test]
async fn an_unreachable_nats_server_is_a_failed_delivery() {
    let config = TransportConfig { connect_timeout: Duration::from_millis(500), ..Default::default() };
    let transport = connect("nats://127.0.0.1:9/x", &config).unwrap();
    let error = transport.deliver(&[("c".to_string(), envelope("f", 1))]).await.unwrap_err();
    assert!(error.to_string().contains("cannot connect to NATS"), "{error}");
}
