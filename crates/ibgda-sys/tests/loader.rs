//! Loaders without the libraries (CI), layouts, and — where rdma-core is installed — a
//! device listing that works with zero NICs.

use std::path::{Path, PathBuf};

use ibgda_sys::search::{LIBGDRAPI, LIBIBVERBS, LIBMLX5, SearchEnv, candidates};
use ibgda_sys::*;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ibgda-sys-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn nowhere(root: &Path) -> SearchEnv {
    SearchEnv {
        home: Some(root.join("home")),
        ld_library_path: vec![root.join("ld")],
        system_dirs: vec![root.join("sys")],
    }
}

#[test]
fn missing_libraries_list_every_place_searched() {
    let root = scratch("missing");
    let env = nowhere(&root);
    let check = |err: Error, file: &str| match err {
        Error::LibraryNotFound {
            library,
            searched,
            hint,
        } => {
            assert_eq!(library, file);
            assert_eq!(
                searched,
                vec![
                    root.join("home/lib").join(file),
                    root.join("home/lib64").join(file),
                    root.join("ld").join(file),
                    root.join("sys").join(file),
                ]
            );
            assert!(!hint.is_empty());
        }
        other => panic!("unexpected {other}"),
    };
    check(
        IbVerbs::load_with(None, &env).unwrap_err(),
        "libibverbs.so.1",
    );
    check(Mlx5Dv::load_with(None, &env).unwrap_err(), "libmlx5.so.1");
    check(GdrApi::load_with(None, &env).unwrap_err(), "libgdrapi.so.2");
    let msg = GdrApi::load_with(None, &env).unwrap_err().to_string();
    assert!(
        msg.contains("gdrdrv")
            && msg.contains(&root.join("sys/libgdrapi.so.2").display().to_string()),
        "{msg}"
    );
}

#[test]
fn explicit_path_is_the_only_place() {
    let root = scratch("explicit");
    let p = root.join("libibverbs.so.1");
    assert_eq!(
        candidates(&LIBIBVERBS, Some(&p), &SearchEnv::default()),
        vec![p.clone()]
    );
    assert_eq!(
        candidates(&LIBMLX5, Some(&root), &SearchEnv::default()),
        vec![root.join("libmlx5.so.1")]
    );
    std::fs::write(&p, b"not ELF").unwrap();
    assert!(matches!(IbVerbs::load(Some(&p)), Err(Error::Load { .. })));
}

#[test]
fn default_search_ends_in_system_dirs() {
    let env = SearchEnv::from_process(&LIBGDRAPI);
    let c = candidates(&LIBGDRAPI, None, &env);
    assert!(
        c.iter()
            .any(|p| p == Path::new("/usr/local/gdrcopy/lib/libgdrapi.so.2"))
    );
    assert!(c.iter().all(|p| p.is_absolute()));
}

#[test]
fn layouts_match_the_headers() {
    use std::mem::{offset_of, size_of};
    assert_eq!(size_of::<ibv_port_attr>(), 52);
    assert_eq!(offset_of!(ibv_port_attr, state), 0);
    assert_eq!(offset_of!(ibv_port_attr, gid_tbl_len), 12);
    assert_eq!(offset_of!(ibv_port_attr, link_layer), 46);
    assert_eq!(size_of::<ibv_device_attr>(), 232);
    assert_eq!(size_of::<ibv_gid>(), 16);
    assert_eq!(size_of::<ibv_gid_entry>(), 32);
    assert_eq!(size_of::<gdr_mh_t>(), 8);
    assert_eq!(IBV_LINK_LAYER_INFINIBAND, 1);
    assert_eq!(IBV_LINK_LAYER_ETHERNET, 2);
    assert_eq!(IBV_PORT_ACTIVE, 4);
    assert_eq!(IBV_GID_TYPE_ROCE_V2, 2);
    assert_eq!(MLX5DV_CONTEXT_FLAGS_DEVX, 1);
}

/// Uses the machine's rdma-core; zero devices (or no kernel RDMA support) is a valid answer, a
/// missing rdma-core fails the test: it is ignored where rdma-core may be absent, and never
/// passes without touching the library (`scripts/gpu-run.sh` skips it, saying so, where
/// `libibverbs.so.1` is absent).
#[test]
#[ignore = "needs rdma-core (libibverbs.so.1) installed: cargo test -- --ignored"]
fn list_devices_where_rdma_core_is_installed() {
    let verbs = IbVerbs::load(None).unwrap_or_else(|e| panic!("rdma-core is needed: {e}"));
    eprintln!(
        "libibverbs at {} (extended entry points: {})",
        verbs.path().display(),
        verbs.ext.is_some()
    );
    let list = match verbs.get_device_list() {
        Ok(l) => l,
        Err(Error::NoRdmaSubsystem) => {
            eprintln!("no kernel RDMA support here (ENOSYS): a valid answer");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    // The safe handles: each device opened, queried, a protection domain allocated, and all of
    // it closed on drop without a recorded failure.
    for dev in list.iter() {
        let name = dev.name();
        match dev.open() {
            Ok(ctx) => {
                let attr = ctx.query_device().unwrap_or_else(|e| panic!("{name}: {e}"));
                let pd = ctx.alloc_pd().unwrap_or_else(|e| panic!("{name}: {e}"));
                eprintln!(
                    "device {name}: {} port(s), pd {:?}",
                    attr.phys_port_cnt,
                    pd.as_raw()
                );
            }
            Err(e) => eprintln!("device {name} does not open here: {e}"),
        }
    }
    assert!(
        verbs.take_drop_error().is_none(),
        "closing a context or freeing a PD failed"
    );
    if let Ok(m) = Mlx5Dv::load(None) {
        eprintln!("libmlx5 at {}", m.path().display());
    }
}
