//! Loader behaviour without NVSHMEM installed, and the ABI mirrors' layouts.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use nvshmem_sys::search::{SearchEnv, candidates, locate};
use nvshmem_sys::*;

fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!(
        "nvshmem-sys-test-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn touch(p: &Path) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, b"not an ELF file").unwrap();
}

fn empty_env(root: &Path) -> SearchEnv {
    SearchEnv {
        system_dirs: vec![root.join("sys")],
        ..SearchEnv::default()
    }
}

#[test]
fn missing_library_lists_every_place_searched() {
    let root = scratch("missing");
    let mut env = empty_env(&root);
    env.nvshmem_dir = Some(root.join("nvshmem"));
    env.ld_library_path = vec![root.join("ld")];
    let err = Nvshmem::load_with(None, &env).unwrap_err();
    let Error::LibraryNotFound { searched } = &err else {
        panic!("wrong error {err}")
    };
    assert!(searched.contains(&root.join("nvshmem/lib/libnvshmem_host.so.3")));
    assert!(searched.contains(&root.join("ld/libnvshmem_host.so.3")));
    assert!(searched.contains(&root.join("sys/libnvshmem_host.so.3")));
    let msg = err.to_string();
    assert!(
        msg.contains(&root.join("ld/libnvshmem_host.so.3").display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("NVSHMEM_DIR"), "{msg}");
}

#[test]
fn explicit_path_is_the_only_place_searched() {
    let root = scratch("explicit");
    let mut env = empty_env(&root);
    touch(&root.join("sys/libnvshmem_host.so.3"));
    env.nvshmem_dir = Some(root.join("other"));
    let want = root.join("nope/libnvshmem_host.so.3");
    match Nvshmem::load_with(Some(&want), &env) {
        Err(Error::LibraryNotFound { searched }) => assert_eq!(searched, vec![want]),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn search_order_dir_then_pip_then_system() {
    let root = scratch("order");
    let venv = root.join("venv");
    touch(&venv.join("bin/python3"));
    let pip = venv.join("lib/python3.12/site-packages/nvidia/nvshmem/lib/libnvshmem_host.so.3");
    touch(&pip);
    let sys = root.join("sys/libnvshmem_host.so.3");
    touch(&sys);
    let mut env = empty_env(&root);
    env.path = vec![venv.join("bin")];
    assert_eq!(locate(None, &env).unwrap(), pip);

    let dir = root.join("nvshmem-install/lib/libnvshmem_host.so.3");
    touch(&dir);
    env.nvshmem_home = Some(root.join("nvshmem-install"));
    assert_eq!(locate(None, &env).unwrap(), dir);

    env.nvshmem_home = None;
    env.path.clear();
    assert_eq!(locate(None, &env).unwrap(), sys);

    let all = candidates(
        None,
        &SearchEnv {
            path: vec![venv.join("bin")],
            ..empty_env(&root)
        },
    );
    let pos = |p: &Path| all.iter().position(|c| c == p).unwrap();
    assert!(pos(&pip) < pos(&sys));
}

#[test]
fn cu12_and_cu13_layouts_are_searched() {
    let root = scratch("cu");
    let venv = root.join("env");
    touch(&venv.join("bin/python3.11"));
    let mut env = empty_env(&root);
    env.path = vec![venv.join("bin")];
    let all = candidates(None, &env);
    assert!(
        all.iter().all(|p| !p.starts_with(&venv)),
        "no site dir exists yet"
    );
    let site = venv.join("lib/python3.11/site-packages");
    std::fs::create_dir_all(&site).unwrap();
    let all = candidates(None, &env);
    for sub in ["nvidia/nvshmem/lib", "nvidia/cu13/lib", "nvidia/cu12/lib"] {
        assert!(
            all.contains(&site.join(sub).join("libnvshmem_host.so.3")),
            "{sub}"
        );
    }
    let cu13 = venv.join("lib/python3.11/site-packages/nvidia/cu13/lib/libnvshmem_host.so.3");
    touch(&cu13);
    assert_eq!(locate(None, &env).unwrap(), cu13);
}

#[test]
fn a_file_that_is_not_a_library_is_a_load_error() {
    let root = scratch("bad");
    let f = root.join("libnvshmem_host.so.3");
    touch(&f);
    match Nvshmem::load(Some(&f)) {
        Err(Error::Load { path, reason }) => {
            assert_eq!(path, f);
            assert!(!reason.is_empty());
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn mirror_layouts() {
    use std::mem::{align_of, offset_of, size_of};
    assert_eq!(size_of::<nvshmemx_uniqueid_t>(), 128);
    assert_eq!(size_of::<nvshmemx_init_attr_t>(), 144);
    assert_eq!(size_of::<nvshmemx_init_args_t>(), 128);
    assert_eq!(size_of::<nvshmemx_uniqueid_args_t>(), 24);
    assert_eq!(size_of::<nvshmem_team_config_t>(), 64);
    assert_eq!(offset_of!(nvshmemx_init_attr_t, args), 16);
    assert_eq!(offset_of!(nvshmemx_init_args_t, uid_args), 8);
    assert_eq!(offset_of!(nvshmemx_uniqueid_args_t, myrank), 16);
    assert_eq!(align_of::<nvshmemx_init_attr_t>(), 8);
    assert_eq!(NVSHMEMX_INIT_ATTR_VERSION, (1 << 16) + 144);
    assert_eq!(NVSHMEMX_UNIQUEID_VERSION, (1 << 16) + 128);
    let attr = nvshmemx_init_attr_t::default();
    assert_eq!(attr.args.uid_args.version, (1 << 16) + 24);
    assert_eq!(attr.args.uid_args.myrank, -1);
}

#[test]
fn unique_id_bytes_round_trip() {
    let mut bytes = [0u8; 128];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = (i * 37 + 11) as u8;
    }
    let uid = nvshmemx_uniqueid_t::from_bytes(&bytes);
    assert_eq!(uid.to_bytes(), bytes);
}

#[test]
fn version_order() {
    let v = |a, b, c| Version {
        major: a,
        minor: b,
        patch: c,
    };
    assert!(v(3, 4, 5) >= MIN_VERSION);
    assert!(v(3, 3, 8) < MIN_VERSION);
    assert!(v(3, 10, 0) > v(3, 9, 99));
    assert_eq!(v(3, 4, 5).to_string(), "3.4.5");
}

/// Loads a real `libnvshmem_host.so.3` (no GPU needed: only pre-init queries).
/// Enable with `EP_TEST_NVSHMEM_LIB=/path/to/libnvshmem_host.so.3 cargo test -- --ignored`;
/// run without it, it fails (it never passes without touching the library).
#[test]
#[ignore = "needs EP_TEST_NVSHMEM_LIB pointing at libnvshmem_host.so.3"]
fn real_library_pre_init_queries() {
    let path = std::env::var_os("EP_TEST_NVSHMEM_LIB")
        .expect("EP_TEST_NVSHMEM_LIB is not set: point it at a libnvshmem_host.so.3");
    let lib = Nvshmem::load(Some(Path::new(&path))).unwrap();
    let v = lib.vendor_version();
    eprintln!("NVSHMEM {v} at {}", lib.path().display());
    assert!(v >= MIN_VERSION);
    assert_eq!(lib.init_status(), 0);
}
