//! The run-time link of variant (b) of the low-latency kernels, without a GPU: the checks before
//! the link, the cache's location and key, and what build.rs recorded.

use std::collections::HashMap;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use ep_kernels::Error;
use ep_kernels::kernels;
use ep_kernels::nvshmem::device_link::{
    DEVICE_LIBRARY, cache_dir_with, cache_file_name, check_device_library,
};
use nvshmem_sys::Version;

const V345: Version = Version {
    major: 3,
    minor: 4,
    patch: 5,
};
const V380: Version = Version {
    major: 3,
    minor: 8,
    patch: 0,
};

/// A fresh empty directory under the target's temp dir.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ep-device-link-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create scratch dir");
    dir
}

#[test]
fn version_mismatch_is_typed_and_says_both_versions_and_the_fix() {
    let dir = scratch("mismatch");
    // The device library is present: the version check alone must refuse.
    std::fs::write(dir.join(DEVICE_LIBRARY), b"!<arch>\n").expect("write");
    let host = dir.join("libnvshmem_host.so.3");
    let err = check_device_library(V345, V380, &host, &dir).expect_err("3.4.5 vs 3.8.0");
    match &err {
        Error::NvshmemDeviceMismatch {
            compiled,
            loaded,
            library,
        } => {
            assert_eq!((*compiled, *loaded), (V345, V380));
            assert_eq!(library, &host.display().to_string());
        }
        other => panic!("expected NvshmemDeviceMismatch, got {other:?}"),
    }
    let msg = err.to_string();
    for needle in [
        "3.4.5",
        "3.8.0",
        &host.display().to_string(),
        "pip install nvidia-nvshmem-cu13==3.4.5",
        "NVSHMEM_HOME",
    ] {
        assert!(msg.contains(needle), "{needle:?} missing from: {msg}");
    }
}

#[test]
fn missing_device_library_is_typed_and_names_the_file() {
    let dir = scratch("missing");
    let host = dir.join("libnvshmem_host.so.3");
    let err = check_device_library(V345, V345, &host, &dir).expect_err("no .a in the dir");
    match &err {
        Error::NvshmemDeviceLibraryMissing { dir: d, version } => {
            assert_eq!(d, &dir.display().to_string());
            assert_eq!(*version, V345);
        }
        other => panic!("expected NvshmemDeviceLibraryMissing, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(msg.contains(DEVICE_LIBRARY), "{msg}");
    assert!(msg.contains(&dir.display().to_string()), "{msg}");
    assert!(msg.contains("nvidia-nvshmem-cu13==3.4.5"), "{msg}");

    // A directory named like the library is not the library.
    std::fs::create_dir(dir.join(DEVICE_LIBRARY)).expect("mkdir");
    assert!(matches!(
        check_device_library(V345, V345, &host, &dir),
        Err(Error::NvshmemDeviceLibraryMissing { .. })
    ));
}

#[test]
fn matching_version_and_present_library_pass() {
    let dir = scratch("ok");
    std::fs::write(dir.join(DEVICE_LIBRARY), b"!<arch>\n").expect("write");
    let got = check_device_library(V380, V380, &dir.join("libnvshmem_host.so.3"), &dir)
        .expect("same version, library present");
    assert_eq!(got, dir.join(DEVICE_LIBRARY));
}

fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
    let map: HashMap<&str, &str> = vars.iter().copied().collect();
    move |k| map.get(k).map(OsString::from)
}

#[test]
fn cache_dir_resolution_order() {
    let all = [
        ("EP_CACHE_DIR", "/ep/cache"),
        ("XDG_CACHE_HOME", "/xdg"),
        ("HOME", "/home/u"),
    ];
    assert_eq!(cache_dir_with(env(&all)), Some(PathBuf::from("/ep/cache")));
    assert_eq!(
        cache_dir_with(env(&all[1..])),
        Some(PathBuf::from("/xdg/ep-rs"))
    );
    assert_eq!(
        cache_dir_with(env(&all[2..])),
        Some(PathBuf::from("/home/u/.cache/ep-rs"))
    );
    assert_eq!(cache_dir_with(env(&[])), None);
    // Empty values are unset; a relative XDG_CACHE_HOME is invalid (XDG base directory spec).
    assert_eq!(
        cache_dir_with(env(&[
            ("EP_CACHE_DIR", ""),
            ("XDG_CACHE_HOME", "rel/cache"),
            ("HOME", "/home/u")
        ])),
        Some(PathBuf::from("/home/u/.cache/ep-rs"))
    );
    assert_eq!(
        cache_dir_with(env(&[("XDG_CACHE_HOME", ""), ("HOME", "")])),
        None
    );
}

#[test]
fn cache_key_changes_with_every_input_and_only_with_them() {
    let cubin: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let base = cache_file_name(&cubin, V345, 1_000_000);
    assert_eq!(base, cache_file_name(&cubin.clone(), V345, 1_000_000));
    let hex = base
        .strip_prefix("ll-nvshmem-3.4.5-")
        .and_then(|r| r.strip_suffix(".cubin"))
        .unwrap_or_else(|| panic!("unexpected shape: {base}"));
    assert_eq!(hex.len(), 16, "{base}");
    assert!(hex.bytes().all(|b| b.is_ascii_hexdigit()), "{base}");

    let mut names = vec![base.clone()];
    names.push(cache_file_name(&cubin, V380, 1_000_000));
    names.push(cache_file_name(
        &cubin,
        Version { patch: 6, ..V345 },
        1_000_000,
    ));
    names.push(cache_file_name(&cubin, V345, 1_000_001));
    for i in [0, 1000, cubin.len() - 1] {
        let mut c = cubin.clone();
        c[i] ^= 1;
        names.push(cache_file_name(&c, V345, 1_000_000));
    }
    names.push(cache_file_name(&cubin[..cubin.len() - 1], V345, 1_000_000));
    // The version is also in the name's text; the hash alone must change with it too.
    let hash = |n: &str| n.rsplit('-').next().map(str::to_owned);
    assert_ne!(hash(&names[0]), hash(&names[1]));
    assert_ne!(hash(&names[0]), hash(&names[2]));
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), names.len(), "collisions among {names:#?}");
}

#[test]
fn headers_recorded_by_the_build_ship_a_device_library() {
    let (Some(version), Some(include)) = (
        kernels::nvshmem_headers_version(),
        kernels::nvshmem_include_dir(),
    ) else {
        eprintln!("skipped: ep-kernels was built without NVSHMEM headers");
        return;
    };
    // The pip wheel (and an NVSHMEM install) keeps include/ and lib/ side by side; build.rs's
    // link check used that library, so a link at run time against it must pass the checks.
    let lib_dir = Path::new(include).join("../lib");
    if !lib_dir.join(DEVICE_LIBRARY).is_file() {
        eprintln!("skipped: no {DEVICE_LIBRARY} beside {include}");
        return;
    }
    let host = lib_dir.join("libnvshmem_host.so.3");
    check_device_library(version, version, &host, &lib_dir).expect("checks pass");
    assert!(version >= nvshmem_sys::MIN_VERSION, "{version}");
}
