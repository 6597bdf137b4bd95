//! The host exchange on loopback: all-gathers return every process's blob in order, many
//! rounds keep their order, barriers hold everyone, every wait is bounded and names who was
//! awaited, a process that dies or runs out of step is an error on the others.

use std::time::{Duration, Instant};

use ep_kernels::Error;
use ep_kernels::exchange::{Exchange, TcpExchange};
use ep_kernels::nvshmem::launch::free_loopback_port;
use ep_kernels::nvshmem::{SessionToken, TcpRendezvous};

fn rdv(port: u16, tok: &SessionToken, timeout: Duration) -> TcpRendezvous {
    TcpRendezvous::loopback(port, tok.clone()).with_timeout(timeout)
}

/// Runs `f(exchange)` on `world` threads, one process rank each; results in rank order.
fn on_threads<T: Send + 'static>(
    world: u32,
    timeout: Duration,
    f: impl Fn(u32, ep_kernels::Result<TcpExchange>) -> T + Send + Sync + Clone + 'static,
) -> Vec<T> {
    let port = free_loopback_port().unwrap();
    let tok = SessionToken::random().unwrap();
    let hs: Vec<_> = (0..world)
        .map(|rank| {
            let r = rdv(port, &tok, timeout);
            let f = f.clone();
            std::thread::spawn(move || f(rank, TcpExchange::connect(&r, rank, world)))
        })
        .collect();
    hs.into_iter().map(|h| h.join().unwrap()).collect()
}

fn blob(rank: u32, round: u32) -> Vec<u8> {
    // Different lengths per rank and round, empty ones included.
    (0..(rank * 37 + round * 11) % 300)
        .map(|i| (i ^ rank ^ (round << 3)) as u8)
        .collect()
}

#[test]
fn all_gather_returns_every_blob_in_rank_order_round_after_round() {
    let world = 4;
    let out = on_threads(world, Duration::from_secs(20), move |rank, ex| {
        let mut ex = ex.unwrap();
        assert_eq!((ex.rank(), ex.world()), (rank, world));
        for round in 0..50 {
            let got = ex.all_gather(&blob(rank, round)).unwrap();
            let want: Vec<Vec<u8>> = (0..world).map(|r| blob(r, round)).collect();
            assert_eq!(got, want, "round {round} on rank {rank}");
            if round % 7 == 0 {
                ex.barrier().unwrap();
            }
        }
        rank
    });
    assert_eq!(out, vec![0, 1, 2, 3]);
}

#[test]
fn a_large_blob_travels_and_an_oversized_one_is_refused() {
    let out = on_threads(2, Duration::from_secs(20), |rank, ex| {
        let mut ex = ex.unwrap();
        let big: Vec<u8> = (0..ep_kernels::exchange::MAX_BLOB_BYTES)
            .map(|i| (i as u32 ^ rank) as u8)
            .collect();
        let got = ex.all_gather(&big).unwrap();
        assert_eq!(got[rank as usize], big);
        assert_eq!(got[1 - rank as usize].len(), big.len());
        let too_big = vec![0u8; ep_kernels::exchange::MAX_BLOB_BYTES + 1];
        matches!(ex.all_gather(&too_big), Err(Error::ExchangeFailed { .. }))
    });
    assert_eq!(out, vec![true, true]);
}

#[test]
fn the_barrier_holds_everyone_until_the_last_arrives() {
    let t0 = Instant::now();
    let out = on_threads(3, Duration::from_secs(20), move |rank, ex| {
        let mut ex = ex.unwrap();
        if rank == 2 {
            std::thread::sleep(Duration::from_millis(300));
        }
        ex.barrier().unwrap();
        t0.elapsed()
    });
    for (r, t) in out.iter().enumerate() {
        assert!(*t >= Duration::from_millis(300), "rank {r} left at {t:?}");
    }
}

#[test]
fn a_missing_process_times_out_naming_it_on_the_root_and_the_others() {
    let out = on_threads(3, Duration::from_millis(400), |rank, ex| {
        let mut ex = ex.unwrap();
        if rank == 2 {
            // Joined, then never takes part (but stays connected until the others gave up).
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let t = Instant::now();
        let err = ex.barrier().unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(5), "bounded");
        // Failed once, failed for good.
        assert!(matches!(ex.barrier(), Err(Error::ExchangeFailed { .. })));
        Some(err.to_string())
    });
    let root = out[0].as_ref().unwrap();
    assert!(root.contains("rank 2's blob"), "{root}");
    let client = out[1].as_ref().unwrap();
    assert!(
        client.contains("rank 2's blob") || client.contains("rank 0 (the root)"),
        "{client}"
    );
}

#[test]
fn a_process_that_exits_is_an_error_not_a_hang() {
    let out = on_threads(2, Duration::from_secs(20), |rank, ex| {
        let mut ex = ex.unwrap();
        ex.barrier().unwrap();
        if rank == 1 {
            drop(ex);
            return None;
        }
        let t = Instant::now();
        let e = ex.barrier().unwrap_err();
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "no wait for the timeout"
        );
        Some(e)
    });
    match &out[0] {
        Some(Error::ExchangeFailed { reason, .. }) => {
            assert!(reason.contains("rank 1"), "{reason}");
        }
        other => panic!("expected ExchangeFailed, got {other:?}"),
    }
}

#[test]
fn a_skipped_collective_is_an_error_naming_the_process() {
    let out = on_threads(2, Duration::from_secs(5), |rank, ex| {
        let mut ex = ex.unwrap();
        if rank == 1 {
            // Rank 1 skips a collective, its next one meets the root's first.
            ex.barrier().unwrap();
            ex.barrier().unwrap();
            return None;
        }
        ex.barrier().unwrap();
        ex.barrier().unwrap();
        ex.barrier().err().map(|e| e.to_string())
    });
    // The root waited for rank 1, which has left: an error naming it, not a hang.
    let e = out[0].as_ref().unwrap();
    assert!(e.contains("rank 1"), "{e}");
}

#[test]
fn the_root_timeout_names_processes_that_never_joined() {
    let port = free_loopback_port().unwrap();
    let tok = SessionToken::random().unwrap();
    let t = Instant::now();
    match TcpExchange::connect(&rdv(port, &tok, Duration::from_millis(300)), 0, 3) {
        Err(e @ Error::RendezvousTimeout { rank: 0, .. }) => {
            assert!(e.to_string().contains("[1, 2]"), "{e}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_nvshmem_rendezvous_client_is_not_an_exchange_client() {
    use ep_kernels::nvshmem::Rendezvous;
    let port = free_loopback_port().unwrap();
    let tok = SessionToken::random().unwrap();
    let r = rdv(port, &tok, Duration::from_secs(10));
    let root = std::thread::spawn(move || TcpExchange::connect(&r, 0, 2).map(|_| ()));
    let nv = rdv(port, &tok, Duration::from_secs(5));
    match nv.unique_id(1, 2, &mut || panic!("not the root")) {
        Err(Error::RendezvousRefused { reason, .. }) => {
            assert!(
                reason.contains("not an ep-rs rendezvous client"),
                "{reason}"
            )
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    let ok = rdv(port, &tok, Duration::from_secs(5));
    let _client = TcpExchange::connect(&ok, 1, 2).unwrap();
    root.join().unwrap().unwrap();
}

#[test]
fn a_world_of_one_needs_no_network() {
    let r = TcpRendezvous::loopback(1, SessionToken::random().unwrap());
    let mut ex = TcpExchange::connect(&r, 0, 1).unwrap();
    assert_eq!(ex.all_gather(b"abc").unwrap(), vec![b"abc".to_vec()]);
    ex.barrier().unwrap();
    assert!(matches!(
        TcpExchange::connect(&r, 1, 1),
        Err(Error::BadRank { .. })
    ));
}

#[test]
fn processes_started_by_the_launcher_exchange_through_the_environment() {
    use ep_kernels::nvshmem::launch::{RankLaunch, is_rank_process, launch_ranks};
    const TEST: &str = "processes_started_by_the_launcher_exchange_through_the_environment";
    if is_rank_process() {
        // A rank: the same path as the GPU tests' (TcpExchange::from_env).
        let mut ex = TcpExchange::from_env().unwrap();
        let me = ex.rank();
        let got = ex
            .all_gather(format!("hello from {me}").as_bytes())
            .unwrap();
        ex.barrier().unwrap();
        let got: Vec<String> = got
            .into_iter()
            .map(|b| String::from_utf8(b).unwrap())
            .collect();
        println!("RANK {me} GOT {}", got.join("|"));
        return;
    }
    let res = launch_ranks(&RankLaunch {
        program: std::env::current_exe().unwrap(),
        args: vec![TEST.into(), "--exact".into(), "--nocapture".into()],
        world: 3,
        plan: Vec::new(),
        extra_env: Vec::new(),
        timeout: Duration::from_secs(60),
    })
    .unwrap();
    for o in &res.outcomes {
        assert_eq!(o.code, Some(0), "rank {}: {}", o.rank, o.output);
        let want = format!("RANK {} GOT hello from 0|hello from 1|hello from 2", o.rank);
        assert!(o.output.contains(&want), "rank {}: {}", o.rank, o.output);
    }
}
