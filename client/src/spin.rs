//! How a thread outside the runtime (a Python caller, any synchronous API over
//! the store) waits for a store call's answer. It polls the call's future
//! itself (inside the store's runtime, whose workers run the I/O) and,
//! while that kind of call usually answers within the spin budget, spins
//! instead of sleeping: on a virtual machine a sleeping thread's CPU halts, and
//! waking it again costs tens of microseconds, as much as the round trip to
//! the sub-master. The spin yields the CPU on every turn, so any other runnable
//! thread still runs. A kind of call that usually takes longer (a 1 MiB copy, a
//! large batch) sleeps at once, and is tried with a spin once in a while, in
//! case it got faster. `HKVM_SPIN_US` sets the budget in microseconds; 0 turns
//! spinning off.

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// The environment variable that sets the spin budget (microseconds).
pub const BUDGET_ENV: &str = "HKVM_SPIN_US";
/// The spin budget when `HKVM_SPIN_US` is unset: a durable put (a direct round
/// trip plus a JetStream append, 250-450 us on the 2-core test machine) and a
/// 1 MiB copy fit it. At 300 us the puts slept, and one client's 4 KiB puts took
/// 400 us instead of 310 us each.
pub const DEFAULT_BUDGET: Duration = Duration::from_micros(1000);
/// One call in this many of a kind that sleeps at once spins anyway, so that
/// its typical wait is learned again without the cost of waking.
const PROBE_EVERY: u64 = 32;
/// The weight of the newest wait in a kind's typical wait (1/8).
const NEWEST_WEIGHT_SHIFT: u32 = 3;

/// The kinds of call whose typical waits are learned apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// Puts, with or without registered memory.
    Put,
    /// Reads, with or without registered memory.
    Get,
    /// Existence and size queries.
    Query,
    /// Everything else (removes, health, set-up of memory).
    Other,
}

impl Call {
    const COUNT: usize = 4;

    fn index(self) -> usize {
        match self {
            Self::Put => 0,
            Self::Get => 1,
            Self::Query => 2,
            Self::Other => 3,
        }
    }
}

/// What one kind of call has shown so far.
#[derive(Debug, Default)]
struct Learned {
    /// Its typical wait, in nanoseconds (0 before the first call).
    typical_ns: AtomicU64,
    /// Calls made, for the probes.
    calls: AtomicU64,
}

/// The spin policy of one store, and the typical wait of each kind of call.
#[derive(Debug)]
pub struct Spinning {
    budget: Duration,
    learned: [Learned; Call::COUNT],
}

impl Spinning {
    /// A policy spinning at most `budget` per wait (none when zero).
    pub fn new(budget: Duration) -> Self {
        Self {
            budget,
            learned: Default::default(),
        }
    }

    /// The policy `HKVM_SPIN_US` asks for, else [`DEFAULT_BUDGET`].
    pub fn from_env() -> Self {
        let budget = std::env::var(BUDGET_ENV)
            .ok()
            .and_then(|value| value.trim().parse::<u64>().ok())
            .map_or(DEFAULT_BUDGET, Duration::from_micros);
        Self::new(budget)
    }

    /// How long a wait of `call` may spin: the budget while its typical wait
    /// fits in it (and on a probe), else nothing.
    fn spin_for(&self, call: Call) -> Duration {
        if self.budget.is_zero() {
            return Duration::ZERO;
        }
        let learned = &self.learned[call.index()];
        let calls = learned.calls.fetch_add(1, Ordering::Relaxed);
        let typical = Duration::from_nanos(learned.typical_ns.load(Ordering::Relaxed));
        if typical <= self.budget || calls % PROBE_EVERY == 0 {
            self.budget
        } else {
            Duration::ZERO
        }
    }

    /// Takes `waited` into `call`'s typical wait.
    fn learn(&self, call: Call, waited: Duration) {
        let slot = &self.learned[call.index()].typical_ns;
        let newest = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        let typical = slot.load(Ordering::Relaxed);
        let next = if typical == 0 {
            newest
        } else {
            typical - (typical >> NEWEST_WEIGHT_SHIFT) + (newest >> NEWEST_WEIGHT_SHIFT)
        };
        slot.store(next, Ordering::Relaxed);
    }

    /// `call`'s typical wait so far.
    #[cfg(test)]
    fn typical(&self, call: Call) -> Duration {
        Duration::from_nanos(
            self.learned[call.index()]
                .typical_ns
                .load(Ordering::Relaxed),
        )
    }
}

/// Wakes the waiting thread: sets the flag it spins on, and unparks it in case
/// it sleeps.
struct Wakeup {
    woken: AtomicBool,
    thread: Thread,
}

impl Wake for Wakeup {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::Release);
        self.thread.unpark();
    }
}

/// Runs `future` to completion on this thread, inside `runtime`'s context,
/// spinning as `spinning` allows for `call`.
pub fn run<F: Future>(
    runtime: &tokio::runtime::Runtime,
    spinning: &Spinning,
    call: Call,
    future: F,
) -> F::Output {
    let spin = spinning.spin_for(call);
    if spin.is_zero() {
        // Tokio's own wait sleeps at once, and is what a non-spinning call
        // should cost.
        let started = Instant::now();
        let output = runtime.block_on(future);
        spinning.learn(call, started.elapsed());
        return output;
    }
    let _entered = runtime.enter();
    let wakeup = Arc::new(Wakeup {
        woken: AtomicBool::new(false),
        thread: std::thread::current(),
    });
    let waker = Waker::from(Arc::clone(&wakeup));
    let mut context = Context::from_waker(&waker);
    let mut future = pin!(future);
    let started = Instant::now();
    loop {
        if let Poll::Ready(output) = future.as_mut().poll(&mut context) {
            spinning.learn(call, started.elapsed());
            return output;
        }
        // Spin until woken or out of budget (counted from the call's start),
        // then sleep until woken.
        while !wakeup.woken.swap(false, Ordering::AcqRel) {
            if started.elapsed() >= spin {
                while !wakeup.woken.swap(false, Ordering::AcqRel) {
                    std::thread::park();
                }
                break;
            }
            std::thread::yield_now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap_or_else(|error| panic!("{error}"))
    }

    #[test]
    fn a_call_answered_by_another_thread_returns_its_output_spinning_or_not() {
        let runtime = runtime();
        for budget in [
            Duration::ZERO,
            Duration::from_micros(50),
            Duration::from_secs(1),
        ] {
            let spinning = Spinning::new(budget);
            for delay_us in [0, 100, 2_000] {
                let (tx, rx) = tokio::sync::oneshot::channel();
                runtime.spawn(async move {
                    tokio::time::sleep(Duration::from_micros(delay_us)).await;
                    let _ = tx.send(delay_us);
                });
                let got = run(&runtime, &spinning, Call::Get, rx);
                assert_eq!(got, Ok(delay_us), "budget {budget:?}");
            }
        }
    }

    #[test]
    fn a_kind_of_call_slower_than_the_budget_stops_spinning_but_probes() {
        let spinning = Spinning::new(Duration::from_micros(300));
        assert_eq!(spinning.spin_for(Call::Put), Duration::from_micros(300));
        for _ in 0..64 {
            spinning.learn(Call::Put, Duration::from_millis(1));
        }
        assert!(spinning.typical(Call::Put) > Duration::from_micros(900));
        let spins = (0..PROBE_EVERY * 4)
            .filter(|_| !spinning.spin_for(Call::Put).is_zero())
            .count();
        assert_eq!(spins, 4, "one probe in {PROBE_EVERY}");
        // Another kind keeps its own record.
        assert_eq!(spinning.spin_for(Call::Query), Duration::from_micros(300));
        for _ in 0..64 {
            spinning.learn(Call::Put, Duration::from_micros(40));
        }
        assert!(spinning.typical(Call::Put) < Duration::from_micros(300));
        assert!((0..8).all(|_| !spinning.spin_for(Call::Put).is_zero()));
    }

    #[test]
    fn a_zero_budget_never_spins() {
        let spinning = Spinning::new(Duration::ZERO);
        assert!((0..100).all(|_| spinning.spin_for(Call::Get).is_zero()));
    }
}
