//! Pacing background work so that it leaves room for the requests: a thread's
//! CPU kept to a share of one core ([`CpuShare`]), and a byte stream kept to a
//! rate ([`ByteRate`]). Snapshots use both: encoding a 10 M-object state is
//! seconds of CPU, and storing and reading back its ~860 MB is as many seconds
//! of the NATS server's, which the leader's writes wait on.
//!
//! Why not only a low priority: on a machine whose cores are all busy (a
//! leader, its clients and nats-server), a thread that never rests raised the
//! leader's put p99 about 2.4x in the soak bench even at the lowest priority
//! (`SCHED_IDLE`), while the same thread working 1 ms and resting 1 ms raised
//! it about 1.1x. Resting between short slices is what gives the time back.

use std::future::Future as _;
use std::time::{Duration, Instant};

/// Work between two looks at the clock, in [`CpuShare::tick`] calls.
const TICKS_PER_LOOK: u32 = 64;

/// How long a slice of work runs before the thread rests.
pub const WORK_SLICE: Duration = Duration::from_millis(1);

/// Keeps the calling thread's work to a share of one core: it works in slices
/// of about [`WORK_SLICE`] and sleeps between them. A share of 1 or more never
/// sleeps.
#[derive(Debug)]
pub struct CpuShare {
    /// Rest per unit of work: `1 / share - 1`.
    rest_per_work: f64,
    slice_started: Instant,
    ticks: u32,
    worked: Duration,
    rested: Duration,
}

impl CpuShare {
    /// Pacing at `share` of one core (clamped to at least 1%); 1 or more (or
    /// NaN) never rests.
    pub fn new(share: f64) -> Self {
        let rest_per_work = if share.is_nan() || share >= 1.0 {
            0.0
        } else {
            1.0 / share.max(0.01) - 1.0
        };
        Self {
            rest_per_work,
            slice_started: Instant::now(),
            ticks: 0,
            worked: Duration::ZERO,
            rested: Duration::ZERO,
        }
    }

    /// Unpaced.
    pub fn unlimited() -> Self {
        Self::new(1.0)
    }

    /// Counts a small unit of work (an object encoded, a few microseconds at
    /// most); once a slice's worth has been done, sleeps its share of rest.
    #[inline]
    pub fn tick(&mut self) {
        self.ticks(1);
    }

    /// Counts `units` small units of work at once (see [`CpuShare::tick`]).
    #[inline]
    pub fn ticks(&mut self, units: u32) {
        if self.rest_per_work == 0.0 {
            return;
        }
        self.ticks = self.ticks.saturating_add(units);
        if self.ticks < TICKS_PER_LOOK {
            return;
        }
        self.ticks = 0;
        let worked = self.slice_started.elapsed();
        if worked >= WORK_SLICE {
            let rest = worked.mul_f64(self.rest_per_work);
            std::thread::sleep(rest);
            self.worked += worked;
            self.rested += rest;
            self.slice_started = Instant::now();
        }
    }

    /// The slices of work that were followed by a rest, in all.
    pub fn worked(&self) -> Duration {
        self.worked
    }

    /// The rests asked for so far (a sleep may last longer).
    pub fn rested(&self) -> Duration {
        self.rested
    }
}

/// Keeps a byte stream to a rate: after each piece, [`ByteRate::pass`] waits
/// until the bytes so far are no ahead of `bytes_per_sec` since the start.
#[derive(Debug)]
pub struct ByteRate {
    bytes_per_sec: Option<u64>,
    started: tokio::time::Instant,
    passed: u64,
}

impl ByteRate {
    /// A rate of `bytes_per_sec` (`None` or 0: unlimited).
    pub fn new(bytes_per_sec: Option<u64>) -> Self {
        Self {
            bytes_per_sec: bytes_per_sec.filter(|&rate| rate > 0),
            started: tokio::time::Instant::now(),
            passed: 0,
        }
    }

    /// Counts `bytes` more and waits as long as they are ahead of the rate.
    pub async fn pass(&mut self, bytes: usize) {
        self.passed += bytes as u64;
        if let Some(due) = self.due() {
            tokio::time::sleep_until(due).await;
        }
    }

    /// When the bytes passed so far are due at the rate (`None`: unlimited).
    fn due(&self) -> Option<tokio::time::Instant> {
        let rate = self.bytes_per_sec?;
        let seconds = self.passed as f64 / rate as f64;
        Some(self.started + Duration::from_secs_f64(seconds))
    }
}

/// Hands out the bytes of a slice, as an [`AsyncRead`](tokio::io::AsyncRead),
/// no faster than a rate: after each read it waits until the bytes read so far
/// are due. What an object store's `put` reads a snapshot from.
pub struct PacedSlice<'a> {
    bytes: &'a [u8],
    rate: ByteRate,
    wait: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl std::fmt::Debug for PacedSlice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PacedSlice")
            .field("left", &self.bytes.len())
            .field("rate", &self.rate)
            .finish_non_exhaustive()
    }
}

impl<'a> PacedSlice<'a> {
    /// `bytes` at `bytes_per_sec` (`None` or 0: as fast as they are read).
    pub fn new(bytes: &'a [u8], bytes_per_sec: Option<u64>) -> Self {
        Self {
            bytes,
            rate: ByteRate::new(bytes_per_sec),
            wait: None,
        }
    }
}

impl tokio::io::AsyncRead for PacedSlice<'_> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if let Some(wait) = self.wait.as_mut() {
            std::task::ready!(wait.as_mut().poll(cx));
            self.wait = None;
        }
        let len = buf.remaining().min(self.bytes.len());
        let (piece, rest) = self.bytes.split_at(len);
        buf.put_slice(piece);
        self.bytes = rest;
        self.rate.passed += len as u64;
        if let Some(due) = self.rate.due() {
            if due > tokio::time::Instant::now() {
                self.wait = Some(Box::pin(tokio::time::sleep_until(due)));
            }
        }
        std::task::Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Busy work of about `for_` on this thread, ticking as it goes.
    fn work(pace: &mut CpuShare, for_: Duration) -> u64 {
        let started = Instant::now();
        let mut ticks = 0;
        while started.elapsed() < for_ {
            pace.tick();
            ticks += 1;
        }
        ticks
    }

    #[test]
    fn a_share_of_one_never_rests() {
        let mut pace = CpuShare::new(1.0);
        work(&mut pace, Duration::from_millis(20));
        assert_eq!(pace.rested(), Duration::ZERO);
        let mut pace = CpuShare::new(f64::NAN);
        work(&mut pace, Duration::from_millis(5));
        assert_eq!(pace.rested(), Duration::ZERO);
    }

    #[test]
    fn a_half_share_rests_as_long_as_it_works() {
        let mut pace = CpuShare::new(0.5);
        work(&mut pace, Duration::from_millis(20));
        // Every slice of work (at least one millisecond, longer on a loaded
        // machine) was followed by a rest as long.
        assert!(pace.worked() >= WORK_SLICE, "{pace:?}");
        let difference = pace.rested().as_secs_f64() - pace.worked().as_secs_f64();
        assert!(difference.abs() < 1e-6, "{pace:?}");
        let mut pace = CpuShare::new(0.25);
        work(&mut pace, Duration::from_millis(10));
        assert!(pace.worked() >= WORK_SLICE, "{pace:?}");
        let ratio = pace.rested().as_secs_f64() / pace.worked().as_secs_f64();
        assert!((ratio - 3.0).abs() < 1e-6, "{pace:?}");
    }

    #[test]
    fn a_small_share_is_clamped_not_infinite() {
        let mut pace = CpuShare::new(0.0);
        assert!((pace.rest_per_work - 99.0).abs() < 1e-9);
        // One slice: rests about 99x a millisecond, not for ever.
        let started = Instant::now();
        work(&mut pace, Duration::from_millis(1));
        pace.ticks = TICKS_PER_LOOK - 1;
        pace.tick();
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(pace.rested() >= Duration::from_millis(99));
    }

    #[tokio::test(start_paused = true)]
    async fn a_byte_rate_spaces_the_pieces() {
        let mut rate = ByteRate::new(Some(1_000));
        let started = tokio::time::Instant::now();
        for _ in 0..10 {
            rate.pass(500).await;
        }
        // 5,000 bytes at 1,000 per second.
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(4_990) && took <= Duration::from_millis(5_100),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_paced_slice_reads_whole_at_its_rate() {
        use tokio::io::AsyncReadExt as _;
        let bytes: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let started = tokio::time::Instant::now();
        let mut read = Vec::new();
        let mut reader = PacedSlice::new(&bytes, Some(2_000));
        let mut piece = [0u8; 1_000];
        loop {
            let len = reader.read(&mut piece).await.unwrap();
            if len == 0 {
                break;
            }
            read.extend_from_slice(&piece[..len]);
        }
        assert_eq!(read, bytes);
        // The last 1,000 bytes are due at 5 s; reading them waits for the
        // 9,000 before them (4.5 s).
        let took = started.elapsed();
        assert!(took >= Duration::from_millis(4_490), "{took:?}");
        assert!(took <= Duration::from_millis(5_100), "{took:?}");
        let mut unpaced = PacedSlice::new(&bytes, None);
        let started = tokio::time::Instant::now();
        let mut all = Vec::new();
        unpaced.read_to_end(&mut all).await.unwrap();
        assert_eq!((all, started.elapsed()), (bytes, Duration::ZERO));
    }

    #[tokio::test(start_paused = true)]
    async fn no_rate_never_waits() {
        for limit in [None, Some(0)] {
            let mut rate = ByteRate::new(limit);
            let started = tokio::time::Instant::now();
            rate.pass(1 << 30).await;
            assert_eq!(started.elapsed(), Duration::ZERO);
        }
    }
}
