//! The two-thread run of `tidemark bench`: the pipeline split the way a deployment splits it, one
//! thread per file. The producer thread advances and relays (the relay lives next to the outbox);
//! it hands each relay batch to the consumer thread and waits for the answers, as it would wait
//! for a consumer process over the network. The consumer thread stores each batch it is handed
//! (`receive_batch`, one transaction) and drains in between, on the same connection. Each file
//! then has one writer, so no transaction waits for another's write lock, and the two threads use
//! the machine's two cores.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rusqlite::Connection;
use tidemark_builtins::reservation::ReservationHandler;
use tidemark_core::flow::{AdvanceOutcome, AdvanceRequest};
use tidemark_core::reservation::ReservationMachine;
use tidemark_core::store::{
    ConsumerSnapshot, ConsumerStore, DrainReport, DrainScope, Endpoints, FlowCursor, Handler, InboxEntry, InboxStatus,
    ProducerStore, PruneReport, ReceiveOutcome, RenameReport,
};
use tidemark_core::{Envelope, Error, Result};
use tidemark_engine::{relay_once, RelayOptions};
use tidemark_store_sqlite::{Durability, SqliteProducer};

use super::{failed, request, sched_delta, Mode, RunStats, Sched};

/// What the two-thread run does.
pub(super) struct Run {
    pub flows: u64,
    pub events_per_flow: u64,
    pub mode: Mode,
    pub durability: Durability,
    pub now_ms: i64,
    pub deadline: Duration,
}

/// One relay batch handed to the consumer thread, and where its answers go.
struct ReceiveRequest {
    items: Vec<(String, Envelope)>,
    now_ms: i64,
    reply: mpsc::Sender<Result<Vec<ReceiveOutcome>>>,
}

/// The consumer as the relay sees it: `receive_batch` is sent to the consumer thread and its
/// answers awaited. The other operations belong to the consumer's own process and are refused.
struct RemoteConsumer {
    requests: mpsc::Sender<ReceiveRequest>,
}

fn not_offered(what: &str) -> Error {
    Error::store(format!("the bench's remote consumer does not offer {what}"))
}

impl ConsumerStore for RemoteConsumer {
    type Target = Connection;

    fn receive_batch(&mut self, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        let (reply, answer) = mpsc::channel();
        let items = items.iter().map(|(consumer_id, event)| (consumer_id.to_string(), (*event).clone())).collect();
        self.requests
            .send(ReceiveRequest { items, now_ms, reply })
            .map_err(|_| Error::io("the consumer thread is gone"))?;
        answer.recv().map_err(|_| Error::io("the consumer thread did not answer"))?
    }

    fn drain(
        &mut self,
        _: &str,
        _: &DrainScope,
        _: usize,
        _: &mut dyn Handler<Connection>,
        _: i64,
    ) -> Result<DrainReport> {
        Err(not_offered("drain"))
    }

    fn inbox(&self, _: &str, _: Option<InboxStatus>, _: usize) -> Result<Vec<InboxEntry>> {
        Err(not_offered("inbox"))
    }

    fn skip_blocked(&mut self, _: &str, _: &str, _: &str, _: i64) -> Result<InboxEntry> {
        Err(not_offered("skip_blocked"))
    }

    fn prune(&mut self, _: i64, _: usize, _: i64) -> Result<PruneReport> {
        Err(not_offered("prune"))
    }

    fn rename_consumer(&mut self, _: &str, _: &str, _: i64) -> Result<RenameReport> {
        Err(not_offered("rename_consumer"))
    }

    fn retire_consumer(&mut self, _: &str, _: &str, _: i64) -> Result<()> {
        Err(not_offered("retire_consumer"))
    }

    fn cursors(&self, _: Option<&str>) -> Result<Vec<FlowCursor>> {
        Err(not_offered("cursors"))
    }

    fn snapshot(&self, _: usize) -> Result<ConsumerSnapshot> {
        Err(not_offered("snapshot"))
    }
}

/// Every endpoint is the one consumer thread (the bench subscribes every consumer id to it).
struct RemoteEndpoints(RemoteConsumer);

impl Endpoints for RemoteEndpoints {
    fn deliver(&mut self, _endpoint: &str, items: &[(&str, &Envelope)], now_ms: i64) -> Result<Vec<ReceiveOutcome>> {
        self.0.receive_batch(items, now_ms)
    }
}

/// Busy time, calls and counts of one kind of work.
#[derive(Default)]
struct Work {
    busy: Duration,
    calls: u64,
    count: u64,
}

impl Work {
    fn add(&mut self, started: Instant, count: u64) {
        self.busy += started.elapsed();
        self.calls += 1;
        self.count += count;
    }
}

/// Run `flows x events_per_flow` events (the same requests as the one-thread run) through two
/// threads. The consumer thread serves a waiting batch before each drain, so the relay waits at
/// most one drain; it sleeps 1 ms when it has nothing to do. Every loop is bounded by `deadline`.
pub(super) fn run_two_threads(
    producer_path: &Path,
    consumer_path: &Path,
    consumer_ids: &[String],
    run: &Run,
) -> Result<RunStats> {
    let total = run.flows * run.events_per_flow;
    let deliveries_due = total * consumer_ids.len() as u64;
    let started = Instant::now();
    let failed_thread = AtomicBool::new(false);
    let stop = |what: &str| -> Option<Error> {
        if failed_thread.load(Ordering::SeqCst) {
            Some(failed(format!("two-thread {what} stopped: the other thread failed")))
        } else if started.elapsed() > run.deadline {
            Some(failed(format!("two-thread {what} did not finish within {:?}", run.deadline)))
        } else {
            None
        }
    };
    let flag = |result: Result<(Work, Work, Option<Sched>)>| {
        if result.is_err() {
            failed_thread.store(true, Ordering::SeqCst);
        }
        result
    };
    let idle = Duration::from_millis(1);
    let (requests, inbox) = mpsc::channel::<ReceiveRequest>();
    let (producer_side, consumer_side) = std::thread::scope(|scope| {
        let producer_side = scope.spawn(move || {
            flag((|| -> Result<(Work, Work, Option<Sched>)> {
                let sched = Sched::now();
                let mut producer = SqliteProducer::open_with(producer_path, run.durability)?;
                let mut endpoints = RemoteEndpoints(RemoteConsumer { requests });
                let options = RelayOptions { limit: run.mode.relay_limit, ..RelayOptions::default() };
                let (mut advanced, mut relayed) = (Work::default(), Work::default());
                let mut next = 0_u64;
                while relayed.count < deliveries_due {
                    if let Some(error) = stop("producer") {
                        return Err(error);
                    }
                    // Advance one wave, then relay what is due (at most one wave ahead).
                    if next < total {
                        let wave_len = (total - next).min(run.mode.advance_batch as u64);
                        let requests: Vec<AdvanceRequest> =
                            (next..next + wave_len).map(|i| request("g", i % run.flows, i / run.flows)).collect();
                        next += wave_len;
                        let t = Instant::now();
                        let outcomes = producer.advance_batch(&ReservationMachine, &requests, run.now_ms)?;
                        advanced.add(t, wave_len);
                        if let Some(other) = outcomes.iter().find(|o| !matches!(o, AdvanceOutcome::Committed { .. })) {
                            return Err(failed(format!("an advance was not committed: {other:?}")));
                        }
                    }
                    let t = Instant::now();
                    let report = relay_once(&mut producer, &mut endpoints, &options, run.now_ms, &mut || 0.5)?;
                    if report.attempted == 0 {
                        std::thread::sleep(idle);
                        continue;
                    }
                    if report.accepted != report.attempted {
                        return Err(failed(format!("relay pass did not accept every delivery: {report:?}")));
                    }
                    relayed.add(t, report.attempted);
                }
                // Dropping `endpoints` closes the channel: the consumer thread then only drains.
                drop(endpoints);
                Ok((advanced, relayed, sched_delta(sched)))
            })())
        });
        let consumer_side = scope.spawn(move || {
            flag((|| -> Result<(Work, Work, Option<Sched>)> {
                let sched = Sched::now();
                let mut consumer = crate::open_consumer(consumer_path, run.durability)?;
                let mut handler = ReservationHandler::new(false);
                let (mut received, mut drained) = (Work::default(), Work::default());
                let mut applied: Vec<u64> = vec![0; consumer_ids.len()];
                let mut relay_done = false;
                while drained.count < deliveries_due {
                    if let Some(error) = stop("consumer") {
                        return Err(error);
                    }
                    // A waiting batch first: the relay is blocked on it.
                    if !relay_done {
                        match inbox.try_recv() {
                            Ok(batch) => {
                                let t = Instant::now();
                                let items: Vec<(&str, &Envelope)> =
                                    batch.items.iter().map(|(c, e)| (c.as_str(), e)).collect();
                                let outcomes = consumer.receive_batch(&items, batch.now_ms);
                                received.add(t, items.len() as u64);
                                // The relay may have failed and gone; its error is reported.
                                let _ = batch.reply.send(outcomes);
                                continue;
                            }
                            Err(mpsc::TryRecvError::Empty) => {}
                            Err(mpsc::TryRecvError::Disconnected) => relay_done = true,
                        }
                    }
                    let mut progressed = false;
                    for (consumer_id, applied) in consumer_ids.iter().zip(applied.iter_mut()) {
                        if *applied == total {
                            continue;
                        }
                        let t = Instant::now();
                        let report = consumer.drain(
                            consumer_id,
                            &DrainScope::All,
                            run.mode.drain_limit,
                            &mut handler,
                            run.now_ms,
                        )?;
                        if report.applied > 0 {
                            drained.add(t, report.applied);
                            *applied += report.applied;
                            progressed = true;
                        }
                    }
                    if !progressed {
                        // Nothing to apply: wait for the next batch (or the end of the relay).
                        match inbox.recv_timeout(idle) {
                            Ok(batch) => {
                                let t = Instant::now();
                                let items: Vec<(&str, &Envelope)> =
                                    batch.items.iter().map(|(c, e)| (c.as_str(), e)).collect();
                                let outcomes = consumer.receive_batch(&items, batch.now_ms);
                                received.add(t, items.len() as u64);
                                let _ = batch.reply.send(outcomes);
                            }
                            Err(mpsc::RecvTimeoutError::Timeout) => {}
                            Err(mpsc::RecvTimeoutError::Disconnected) => relay_done = true,
                        }
                    }
                }
                Ok((received, drained, sched_delta(sched)))
            })())
        });
        let join = |handle: std::thread::ScopedJoinHandle<'_, Result<(Work, Work, Option<Sched>)>>| {
            handle.join().unwrap_or_else(|_| Err(failed("a two-thread run's thread panicked".into())))
        };
        (join(producer_side), join(consumer_side))
    });
    let ((advanced, relayed, producer_sched), (received, drained, consumer_sched)) = (producer_side?, consumer_side?);
    let sched = producer_sched
        .zip(consumer_sched)
        .map(|(a, b)| Sched { on_cpu_ns: a.on_cpu_ns + b.on_cpu_ns, run_queue_ns: a.run_queue_ns + b.run_queue_ns });
    Ok(RunStats {
        events: advanced.count,
        deliveries: relayed.count,
        applied: drained.count,
        advance_transactions: advanced.calls,
        relay_passes: relayed.calls,
        drain_transactions: drained.calls,
        advance: advanced.busy,
        // The relay's busy time includes the wait for the consumer thread's receive.
        relay: relayed.busy.max(received.busy),
        drain: drained.busy,
        total: started.elapsed(),
        sched,
        threads: producer_sched
            .map(|s| ("advance_and_relay", s))
            .into_iter()
            .chain(consumer_sched.map(|s| ("receive_and_drain", s)))
            .collect(),
    })
}
