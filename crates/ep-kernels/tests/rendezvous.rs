//! The unique-id rendezvous on loopback: every rank gets the root's id, wrong tokens are
//! refused, every wait is bounded and its error names who was awaited.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::{Duration, Instant};

use ep_kernels::Error;
use ep_kernels::nvshmem::launch::free_loopback_port;
use ep_kernels::nvshmem::{CallerFedRendezvous, Rendezvous, SessionToken, TcpRendezvous, UniqueId};

fn id(seed: u8) -> UniqueId {
    let mut b = [0u8; 128];
    for (i, x) in b.iter_mut().enumerate() {
        *x = seed.wrapping_mul(31).wrapping_add(i as u8);
    }
    UniqueId(b)
}

fn token() -> SessionToken {
    SessionToken::random().unwrap()
}

fn never() -> impl FnMut() -> ep_kernels::Result<UniqueId> {
    || panic!("only the root creates the id")
}

#[test]
fn every_rank_gets_the_roots_id() {
    let port = free_loopback_port().unwrap();
    let tok = token();
    let world = 4;
    let want = id(7);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let r =
                TcpRendezvous::loopback(port, tok.clone()).with_timeout(Duration::from_secs(20));
            std::thread::spawn(move || {
                if rank == 0 {
                    r.unique_id(0, world, &mut || Ok(want))
                } else {
                    r.unique_id(rank, world, &mut never())
                }
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap().unwrap(), want);
    }
}

#[test]
fn wrong_token_is_refused_and_root_keeps_waiting() {
    let port = free_loopback_port().unwrap();
    let good = token();
    let root = TcpRendezvous::loopback(port, good.clone()).with_timeout(Duration::from_secs(20));
    let want = id(3);
    let root = std::thread::spawn(move || root.unique_id(0, 2, &mut || Ok(want)));
    let bad = TcpRendezvous::loopback(port, token()).with_timeout(Duration::from_secs(10));
    match bad.unique_id(1, 2, &mut never()) {
        Err(Error::RendezvousRefused {
            rank: 1, reason, ..
        }) => assert!(reason.contains("token"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let wrong_world =
        TcpRendezvous::loopback(port, good.clone()).with_timeout(Duration::from_secs(10));
    assert!(matches!(
        wrong_world.unique_id(1, 3, &mut never()),
        Err(Error::RendezvousRefused { .. })
    ));
    let ok = TcpRendezvous::loopback(port, good).with_timeout(Duration::from_secs(10));
    assert_eq!(ok.unique_id(1, 2, &mut never()).unwrap(), want);
    assert_eq!(root.join().unwrap().unwrap(), want);
}

#[test]
fn root_timeout_names_missing_ranks() {
    let port = free_loopback_port().unwrap();
    let r = TcpRendezvous::loopback(port, token()).with_timeout(Duration::from_millis(300));
    let t = Instant::now();
    match r.unique_id(0, 3, &mut || Ok(id(1))) {
        Err(e @ Error::RendezvousTimeout { rank: 0, .. }) => {
            let msg = e.to_string();
            assert!(msg.contains("[1, 2]"), "{msg}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn client_timeout_names_the_root() {
    let port = free_loopback_port().unwrap();
    let r = TcpRendezvous::loopback(port, token()).with_timeout(Duration::from_millis(300));
    let t = Instant::now();
    match r.unique_id(2, 3, &mut never()) {
        Err(e @ Error::RendezvousTimeout { rank: 2, .. }) => {
            assert!(e.to_string().contains("rank 0 (the root)"), "{e}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn all_interfaces_needs_opt_in() {
    let addr = SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::UNSPECIFIED,
        free_loopback_port().unwrap(),
    ));
    let r = TcpRendezvous::new(addr, token()).with_timeout(Duration::from_millis(50));
    assert!(matches!(
        r.unique_id(0, 2, &mut || Ok(id(0))),
        Err(Error::RendezvousUnspecifiedAddress { .. })
    ));
}

#[test]
fn single_rank_needs_no_network() {
    let r = TcpRendezvous::loopback(1, token());
    assert_eq!(r.unique_id(0, 1, &mut || Ok(id(9))).unwrap(), id(9));
    assert!(matches!(
        r.unique_id(1, 1, &mut never()),
        Err(Error::BadRank { .. })
    ));
}

#[test]
fn short_tokens_are_rejected() {
    assert!(matches!(
        SessionToken::new("short"),
        Err(Error::RendezvousToken { .. })
    ));
    assert!(SessionToken::new("0123456789abcdef").is_ok());
    assert_eq!(token().as_str().len(), 64);
    assert_ne!(token(), token());
}

#[test]
fn caller_fed_returns_the_fed_bytes() {
    let want = id(5);
    let r = CallerFedRendezvous::new(&want.0).unwrap();
    for rank in 0..4 {
        assert_eq!(r.unique_id(rank, 4, &mut never()).unwrap(), want);
    }
    assert!(matches!(
        CallerFedRendezvous::new(&[0u8; 100]),
        Err(Error::UniqueId { .. })
    ));
}
