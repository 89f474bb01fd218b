//! The leader's state machine: one task owns the state and handles requests in
//! order — decide, apply (tentatively), submit the events to group commit — while
//! reply tasks wait for durability. Nothing is acknowledged before JetStream
//! acknowledged it, and a read waits until every earlier write is durable, so no
//! client ever sees state that a crash could take back. Any failed append (a
//! fencing conflict above all) ends the leadership: the state may then hold
//! changes that are not durable, so it is rebuilt from the log.

use std::sync::Arc;
use std::time::{Duration, Instant as StdInstant};

use bytes::Bytes;
use hkvm_events::codec::{encode_message, Header};
use hkvm_events::registry::SubmasterInfo;
use hkvm_events::rpc::direct::DirectWelcome;
use hkvm_events::rpc::{RpcError, RpcErrorCode};
use hkvm_events::subject::{epoch_marker_id, leader_subject, submaster_rpc_subject};
use hkvm_events::KvEvent;
use hkvm_log::commit::{CommitError, GroupCommitter, PendingCommit};
use hkvm_log::connection::ConnectionEpoch;
use hkvm_log::registry;
use hkvm_log::{Append, EventLog, LogErrorKind};
use hkvm_telemetry::metrics::gauge_value;
use tokio::sync::{mpsc, watch};
use tokio::time::{interval, Instant, MissedTickBehavior};

use super::direct::DirectFront;
use super::follower::catch_up;
use super::renewer::{LeaseState, Renewer};
use super::rpc::{self, Job, Requester};
use super::snapshotter::{Snapshotter, StandbyWatch};
use super::Context;
use crate::command::{self, ServingInfo};
use crate::election::LeaseHolder;
use crate::error::{SubmasterError, SubmasterErrorKind};
use crate::liveness::{collect_pings, LiveNodes};
use crate::state::State;

/// Why a leadership ended.
#[derive(Debug)]
pub(crate) enum LeadEnd {
    /// Asked to stop.
    Shutdown,
    /// Lost the lease or an append failed; the state must be rebuilt.
    SteppedDown(String),
}

/// Attempts to open the epoch by appending an empty message fenced on the state's
/// last sequence; a concurrent append by a deposed leader makes us catch up first.
async fn open_epoch(ctx: &Context, state: &mut State) -> Result<u64, SubmasterError> {
    let epoch = state.max_epoch + 1;
    for _ in 0..20 {
        let header = Header {
            producer: ctx.config.producer.clone(),
            epoch,
            unix_ms: registry::now_unix_ms(),
        };
        let payload = encode_message(&header, &[], &ctx.config.policy.limits).map_err(|e| {
            SubmasterError::caused(SubmasterErrorKind::Log, "encoding the epoch marker", e)
        })?;
        let append = Append {
            expected_last_seq: Some(state.applied_seq),
            msg_id: epoch_marker_id(&ctx.config.producer, epoch),
            payload: Bytes::from(payload),
        };
        match ctx.log.append(append).await {
            Ok(ack) => {
                state.apply_message(ack.seq, epoch, &[]);
                return Ok(epoch);
            }
            Err(error) if matches!(error.kind(), LogErrorKind::Fenced { .. }) => {
                tracing::warn!("another writer appended during the takeover; catching up");
                catch_up(&ctx.log, state, &ctx.metrics).await?;
            }
            Err(error) => return Err(error.into()),
        }
    }
    Err(SubmasterError::new(
        SubmasterErrorKind::Log,
        "could not open the epoch: the log kept moving",
    ))
}

/// Splits events into submissions that each fit one message comfortably.
fn submissions(events: Vec<KvEvent>, max_bytes: usize) -> Vec<Vec<KvEvent>> {
    let budget = max_bytes / 2;
    let estimate = |event: &KvEvent| match event {
        KvEvent::PutCommitted(put) => put.key.len() + 48 + 24 * put.placements.len(),
        KvEvent::Evicted(e) => e.keys.iter().map(|k| k.len() + 4).sum::<usize>() + 16,
        KvEvent::Removed(e) => e.keys.iter().map(|k| k.len() + 4).sum::<usize>() + 16,
        _ => 256,
    };
    let mut groups: Vec<Vec<KvEvent>> = Vec::new();
    let mut size = 0;
    for event in events {
        let cost = estimate(&event);
        if groups.is_empty() || size + cost > budget {
            groups.push(Vec::new());
            size = 0;
        }
        size += cost;
        if let Some(group) = groups.last_mut() {
            group.push(event);
        }
    }
    groups
}

struct Leadership<'a> {
    ctx: &'a Context,
    committer: GroupCommitter,
    serving: ServingInfo,
    clock: Instant,
    /// The configured policy with this leadership's grant signer.
    policy: command::Policy,
    /// Writes submitted so far (each gets the next index).
    write_index: u64,
    /// The highest write index known durable (writes complete in order).
    durable: Arc<watch::Sender<u64>>,
    failures: mpsc::UnboundedSender<String>,
    events_since_snapshot: u64,
    last_snapshot: Instant,
    /// The registry write of the last heartbeat, while it runs.
    heartbeat: Option<tokio::task::JoinHandle<()>>,
    /// The nodes this leader knows, for its RPC front's ping answers.
    live: Arc<LiveNodes>,
    snapshotter: Snapshotter,
    /// Whether a hot standby writes the snapshots.
    standby: StandbyWatch,
}

impl Leadership<'_> {
    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }

    /// Submits events in order; returns one future per submission.
    async fn submit(&mut self, events: Vec<KvEvent>) -> Result<Vec<PendingCommit>, CommitError> {
        let mut pending = Vec::new();
        for group in submissions(events, self.ctx.config.policy.limits.max_message_bytes) {
            self.ctx.metrics.events_appended.inc_by(group.len() as u64);
            self.ctx.metrics.commit_events.observe(group.len() as f64);
            self.events_since_snapshot += group.len() as u64;
            pending.push(self.committer.submit(group).await?);
        }
        Ok(pending)
    }

    /// Spawns the task that waits for `pending` and then sends `body` (or an error)
    /// to `job`'s requester, whom the request loop took at `picked`.
    fn reply_when_durable(
        &mut self,
        pending: Vec<PendingCommit>,
        job: Option<(Requester, StdInstant)>,
        body: Vec<u8>,
    ) {
        let submitted = StdInstant::now();
        self.write_index += 1;
        let index = self.write_index;
        let (durable, failures) = (Arc::clone(&self.durable), self.failures.clone());
        let (client, metrics) = (self.ctx.client.clone(), self.ctx.metrics.clone());
        tokio::spawn(async move {
            let mut failed = None;
            let mut last = None;
            for commit in pending {
                match commit.await {
                    Ok(committed) => last = Some(committed),
                    Err(error) => {
                        failed = Some(error);
                        break;
                    }
                }
            }
            match failed {
                None => {
                    durable.send_modify(|done| *done = (*done).max(index));
                    if let Some((job, picked)) = job {
                        metrics.request(job.op.name(), "ok", job.received.elapsed().as_secs_f64());
                        rpc::send(&client, job.reply_to, body).await;
                        if let Some(committed) = last {
                            metrics.write_stages_of(
                                job.received.into_std(),
                                picked,
                                submitted,
                                &committed,
                            );
                        }
                    }
                }
                Some(error) => {
                    let _ = failures.send(error.to_string());
                    if let Some((job, _)) = job {
                        metrics.request(
                            job.op.name(),
                            "error",
                            job.received.elapsed().as_secs_f64(),
                        );
                        let error = RpcError::new(
                            RpcErrorCode::NotLeader,
                            format!("not committed: {error}"),
                        );
                        rpc::send(&client, job.reply_to, rpc::encode_error(&error)).await;
                    }
                }
            }
        });
    }

    /// Answers `Busy` to a request that must not be served now.
    async fn refuse_busy(&self, job: Job) {
        let requester = job.requester;
        self.ctx.metrics.request(
            requester.op.name(),
            "busy",
            requester.received.elapsed().as_secs_f64(),
        );
        let retry_after_ms =
            u64::try_from(self.ctx.config.busy_retry_after.as_millis()).unwrap_or(u64::MAX);
        let error = RpcError::busy(retry_after_ms, "the leader lease is unconfirmed");
        rpc::send(
            &self.ctx.client,
            requester.reply_to,
            rpc::encode_error(&error),
        )
        .await;
    }

    /// Replies to a request that changed nothing durable; reads wait for earlier writes.
    fn reply_after_earlier_writes(&self, job: Requester, body: Vec<u8>) {
        let needed = self.write_index;
        let mut durable = self.durable.subscribe();
        let (client, metrics) = (self.ctx.client.clone(), self.ctx.metrics.clone());
        tokio::spawn(async move {
            let ready = needed == 0 || durable.wait_for(|done| *done >= needed).await.is_ok();
            let (result, body) = if ready {
                ("ok", body)
            } else {
                let error = RpcError::new(
                    RpcErrorCode::NotLeader,
                    "stepped down before the read was safe",
                );
                ("error", rpc::encode_error(&error))
            };
            metrics.request(job.op.name(), result, job.received.elapsed().as_secs_f64());
            rpc::send(&client, job.reply_to, body).await;
        });
    }

    async fn handle(&mut self, state: &mut State, job: Job) -> Result<(), CommitError> {
        let picked = StdInstant::now();
        let Job { requester, request } = job;
        tracing::trace!(op = requester.op.name(), "handling");
        let now = self.now_ms();
        let reads = request.reads_objects();
        state.applied_seq = state.applied_seq.max(self.committer.durable_seq());
        match command::handle(state, request, now, &self.policy, &self.serving) {
            Err(error) => {
                self.ctx.metrics.request(
                    requester.op.name(),
                    "error",
                    requester.received.elapsed().as_secs_f64(),
                );
                rpc::send(
                    &self.ctx.client,
                    requester.reply_to,
                    rpc::encode_error(&error),
                )
                .await;
            }
            Ok(outcome) => {
                for event in &outcome.events {
                    state.apply(event);
                }
                self.live.sync(state, &outcome.events);
                let body = rpc::encode_reply(outcome.reply);
                if outcome.events.is_empty() {
                    if reads && self.write_index > *self.durable.borrow() {
                        self.reply_after_earlier_writes(requester, body);
                    } else {
                        self.ctx.metrics.request(
                            requester.op.name(),
                            "ok",
                            requester.received.elapsed().as_secs_f64(),
                        );
                        rpc::send(&self.ctx.client, requester.reply_to, body).await;
                    }
                } else {
                    let pending = self.submit(outcome.events).await?;
                    self.reply_when_durable(pending, Some((requester, picked)), body);
                }
            }
        }
        Ok(())
    }

    async fn maintain(&mut self, state: &mut State) -> Result<(), CommitError> {
        collect_pings(state, self.live.take_pings());
        let events = command::maintain(state, self.now_ms(), &self.policy);
        if events.is_empty() {
            return Ok(());
        }
        for event in &events {
            match event {
                KvEvent::Evicted(evicted) => {
                    self.ctx.metrics.evicted.inc_by(evicted.keys.len() as u64);
                }
                KvEvent::NodeLost(_) => {
                    self.ctx.metrics.nodes_lost.inc();
                }
                _ => {}
            }
            state.apply(event);
        }
        self.live.sync(state, &events);
        let pending = self.submit(events).await?;
        self.reply_when_durable(pending, None, Vec::new());
        Ok(())
    }

    /// Starts a snapshot of the state as of everything submitted so far; it is
    /// built and written in the background ([`Snapshotter`]); the request loop
    /// copies the state only after durable history could not rebuild it.
    async fn snapshot(&mut self, state: &State) -> Result<(), CommitError> {
        // A hot standby writes them from its own fold.
        if !self.standby.standby_snapshots() {
            self.snapshotter
                .start_leading(
                    &self.committer,
                    &self.ctx.snapshot_sink(),
                    &self.ctx.log,
                    state,
                )
                .await?;
        }
        self.events_since_snapshot = 0;
        self.last_snapshot = Instant::now();
        Ok(())
    }

    fn snapshot_due(&self) -> bool {
        let config = &self.ctx.config;
        // One snapshot at a time, whichever of the two triggers fires.
        !self.snapshotter.busy()
            && (self.events_since_snapshot >= config.snapshot_every_events
                || (self.events_since_snapshot > 0
                    && self.last_snapshot.elapsed() >= config.snapshot_interval))
    }

    fn publish_gauges(&self, state: &State) {
        let (capacity, used) = state.usage();
        let metrics = &self.ctx.metrics;
        metrics
            .objects
            .set(gauge_value(state.object_count() as u64));
        metrics
            .pending_puts
            .set(gauge_value(state.pending.len() as u64));
        metrics
            .space_leases
            .set(gauge_value(state.leases.len() as u64));
        metrics.used_bytes.set(gauge_value(used));
        metrics.capacity_bytes.set(gauge_value(capacity));
        metrics
            .applied_seq
            .set(gauge_value(self.committer.durable_seq()));
    }

    /// Announces this leader in the registry, on its own task: a registry write
    /// waiting out its bucket's JetStream leader election must not hold up
    /// requests. A heartbeat still running skips this one.
    fn heartbeat(&mut self, state: &State) {
        let Some(store) = &self.ctx.registry else {
            return;
        };
        if self
            .heartbeat
            .as_ref()
            .is_some_and(|running| !running.is_finished())
        {
            return;
        }
        let config = &self.ctx.config;
        let (capacity, used) = state.usage();
        let info = SubmasterInfo {
            id: config.producer.clone(),
            cluster: config.cluster.clone(),
            subcluster: config.subcluster.clone(),
            rpc_prefix: submaster_rpc_subject(&config.cluster, &config.subcluster, "")
                .trim_end_matches('.')
                .to_owned(),
            labels: config.labels.clone(),
            capacity_bytes: capacity,
            used_bytes: used,
            objects: state.object_count() as u64,
            epoch: self.serving.epoch,
            stream: self.ctx.log.stream_name().to_owned(),
            last_seq: self.committer.durable_seq(),
            unix_ms: 0,
        };
        let store = store.clone();
        self.heartbeat = Some(tokio::spawn(async move {
            if let Err(error) = registry::heartbeat(&store, &info).await {
                tracing::warn!(%error, "registry heartbeat failed");
            }
        }));
    }
}

/// Tells the clients waiting out a failover that this sub-master serves now
/// (best effort: a client that misses it retries after its back-off anyway).
async fn announce(ctx: &Context, holder: &LeaseHolder) {
    let subject = leader_subject(&ctx.config.cluster, &ctx.config.subcluster);
    let body = match hkvm_events::rpc::encode(holder) {
        Ok(body) => body,
        Err(error) => {
            tracing::warn!(%error, "could not encode the leader announcement");
            return;
        }
    };
    if let Err(error) = ctx.client.publish(subject, body.into()).await {
        tracing::warn!(%error, "could not announce the new leader");
    }
}

/// Leads until shutdown, a lost lease or a failed append.
///
/// # Errors
/// When the takeover itself fails (the caller retries as a standby).
pub(crate) async fn lead(
    ctx: &Context,
    state: &mut State,
    lease_revision: u64,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<LeadEnd, SubmasterError> {
    let config = &ctx.config;
    ctx.metrics.role.set(1);
    // Answer Busy while recovering, instead of leaving requests without a responder.
    let (ready_tx, ready_rx) = watch::channel(false);
    let (jobs_tx, mut jobs) = mpsc::channel(config.request_queue);
    let live = Arc::new(LiveNodes::new());
    let gate = rpc::Gate::new(ctx, jobs_tx, Arc::clone(&live), ready_rx);
    let front = rpc::subscribe(ctx, &gate).await?;
    let started = std::time::Instant::now();
    catch_up(&ctx.log, state, &ctx.metrics).await?;
    let epoch = open_epoch(ctx, state).await?;
    // Bound before serving, so that the announcement and the renewed lease
    // carry the endpoint; it closes with this leadership.
    let welcome = DirectWelcome {
        server: config.producer.to_string(),
        epoch,
    };
    let direct = DirectFront::start(ctx, gate, welcome).await?;
    let holder = LeaseHolder {
        producer: config.producer.clone(),
        epoch,
        direct: direct.as_ref().map(|front| front.endpoint.clone()),
        direct_ticket: direct.as_ref().map(|front| front.ticket.clone()),
    };

    let clock = Instant::now();
    state.pending.clear();
    state.liveness.clear();
    state.grace_until_ms = config.policy.lease_ttl_ms;
    live.lead(epoch, clock, state);
    let committer = GroupCommitter::spawn(
        ctx.log.clone(),
        config.producer.clone(),
        epoch,
        state.applied_seq,
        config.commit,
    );
    let (failures_tx, mut failures) = mpsc::unbounded_channel();
    let mut leadership = Leadership {
        ctx,
        committer,
        serving: ServingInfo {
            producer: config.producer.to_string(),
            epoch,
        },
        clock,
        policy: command::Policy {
            // The state clock starts at `clock`: its 0 is now in Unix time.
            grants: Some(command::GrantSigner::new(
                ctx.grant_key.clone(),
                registry::now_unix_ms(),
            )),
            ..config.policy.clone()
        },
        write_index: 0,
        durable: Arc::new(watch::channel(0).0),
        failures: failures_tx,
        events_since_snapshot: 0,
        last_snapshot: Instant::now(),
        heartbeat: None,
        live,
        snapshotter: Snapshotter::default(),
        standby: StandbyWatch::spawn(
            ctx.positions.clone(),
            config.subcluster.clone(),
            config.producer.clone(),
            ctx.metrics.standby_snapshots.clone(),
        ),
    };
    ctx.metrics.takeovers.inc();
    ctx.metrics.role.set(2);
    let _ = ready_tx.send(true);
    tracing::info!(
        epoch,
        applied_seq = state.applied_seq,
        objects = state.object_count(),
        takeover_ms = started.elapsed().as_millis() as u64,
        "leading the sub-cluster"
    );
    leadership.heartbeat(state);
    let mut connection = ConnectionEpoch::of(&ctx.client);
    announce(ctx, &holder).await;

    let mut maintenance = interval(config.maintenance_interval);
    // The lease is renewed by its own task, so a long step of the state machine (a
    // snapshot of a large state) cannot make it lapse; fencing keeps the log safe
    // whatever the lease says.
    let renewer = Renewer::spawn(
        ctx.lease.clone(),
        holder.clone(),
        lease_revision,
        config.leader_lease_ttl / 3,
    );
    let mut lease_state = renewer.state.clone();
    let mut heartbeat = interval(config.registry_ttl / 3);
    for timer in [&mut maintenance, &mut heartbeat] {
        timer.set_missed_tick_behavior(MissedTickBehavior::Delay);
    }
    let end = loop {
        let step: Result<(), CommitError> = tokio::select! {
            biased;
            _ = shutdown.changed() => break LeadEnd::Shutdown,
            Some(reason) = failures.recv() => break LeadEnd::SteppedDown(reason),
            changed = lease_state.changed() => {
                let state = *lease_state.borrow_and_update();
                match (changed, state) {
                    (Err(_), _) | (_, LeaseState::Lost) => {
                        break LeadEnd::SteppedDown("the leader lease was lost".into())
                    }
                    (Ok(()), LeaseState::Unconfirmed) => { let _ = ready_tx.send(false); }
                    (Ok(()), LeaseState::Held) => {
                        // Renewed (or taken again after it expired). Any leader
                        // that led meanwhile opened its epoch in the log, so an
                        // empty append fenced on our last sequence tells: it
                        // fails if the log moved without us.
                        if let Err(error) = leadership.committer.commit(Vec::new()).await {
                            break LeadEnd::SteppedDown(format!("the log moved while the lease was unconfirmed: {error}"));
                        }
                        tracing::info!("lease renewed and the log unchanged: serving again");
                        let _ = ready_tx.send(true);
                    }
                }
                Ok(())
            }
            _ = maintenance.tick() => {
                leadership.publish_gauges(state);
                leadership.maintain(state).await
            }
            _ = heartbeat.tick() => { leadership.heartbeat(state); Ok(()) }
            () = connection.replaced() => {
                // Replies to requests that came in on the old connection were lost
                // with it: announcing again makes clients send those again now
                // rather than after their request timeout.
                connection = ConnectionEpoch::of(&ctx.client);
                // Only a leader whose lease is confirmed: one back from a network
                // cut may have been deposed meanwhile, and must not draw requests.
                if *lease_state.borrow() == LeaseState::Held {
                    tracing::info!("NATS connection replaced: announcing this leader again");
                    announce(ctx, &holder).await;
                }
                Ok(())
            }
            Some(job) = jobs.recv() => {
                if *lease_state.borrow() == LeaseState::Held {
                    leadership.handle(state, job).await
                } else {
                    // Queued before the lease went unconfirmed: not served either.
                    leadership.refuse_busy(job).await;
                    Ok(())
                }
            }
        };
        if let Err(error) = step {
            break LeadEnd::SteppedDown(error.to_string());
        }
        if leadership.snapshot_due() {
            if let Err(error) = leadership.snapshot(state).await {
                break LeadEnd::SteppedDown(error.to_string());
            }
        }
    };
    let _ = ready_tx.send(false);
    drop(front);
    // No new direct requests; replies owed are still written, then each
    // connection closes and its client turns to NATS and the next leader.
    drop(direct);
    ctx.metrics.role.set(0);
    if matches!(end, LeadEnd::Shutdown) {
        // Let in-flight writes finish and their replies go out, then hand over.
        let needed = leadership.write_index;
        let mut durable = leadership.durable.subscribe();
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            durable.wait_for(|done| *done >= needed),
        )
        .await;
        let revision = renewer.stop().await;
        ctx.lease.release(revision).await;
    }
    Ok(end)
}
