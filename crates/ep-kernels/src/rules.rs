//! The per-token protocol rules of `include/ep_protocol.cuh`, compiled for the host by build.rs
//! (a C++ shim, no CUDA) and exposed here through FFI, so tests can check the CUDA header against
//! `ep_core::protocol` (`tests/protocol_rules.rs`). Each wrapper calls the header function of the
//! same name (`ep_shim_` + name in the shim, `ep_` + name in the header).

/// A low-latency layout `(R, L, H, N)`, as `ep_ll_layout` in the header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LlDims {
    /// `R`.
    pub num_ranks: u64,
    /// `L`.
    pub num_local_experts: u64,
    /// `H`.
    pub hidden: u64,
    /// `N`.
    pub num_max_tokens: u64,
}

mod ffi {
    // The shim's functions are pure arithmetic on integers (see build.rs, SHIM).
    unsafe extern "C" {
        pub(super) fn ep_shim_align16(x: u64) -> u64;
        pub(super) fn ep_shim_align128(x: u64) -> u64;
        pub(super) fn ep_shim_channel_range(t: u64, c: u64, i: u64, s: *mut u64, e: *mut u64);
        pub(super) fn ep_shim_ll_send_group(t: u64, g: u64, b: u64, s: *mut u64, e: *mut u64);
        pub(super) fn ep_shim_channel_half(
            t: u64,
            c: u64,
            i: u64,
            h: u64,
            s: *mut u64,
            e: *mut u64,
        );
        pub(super) fn ep_shim_parity(call: u64) -> u64;
        pub(super) fn ep_shim_epoch_word(call: u64) -> u64;
        pub(super) fn ep_shim_counted(call: u64, count: u32) -> u64;
        pub(super) fn ep_shim_ll_encode(call: u64, count: u32) -> u64;
        pub(super) fn ep_shim_ll_threshold(call: u64) -> u64;
        pub(super) fn ep_shim_ll_epoch(v: u64) -> u64;
        pub(super) fn ep_shim_ll_count(v: u64) -> u32;
        pub(super) fn ep_shim_normal_ctrl_bytes(r: u64) -> u64;
        pub(super) fn ep_shim_normal_notify(r: u64, p: u64, s: u64) -> u64;
        pub(super) fn ep_shim_normal_table_ready(r: u64, p: u64) -> u64;
        pub(super) fn ep_shim_normal_done(r: u64, s: u64, c: u64, h: u64) -> u64;
        pub(super) fn ep_shim_normal_pulled(r: u64, s: u64, c: u64) -> u64;
        pub(super) fn ep_shim_normal_ready(r: u64, d: u64) -> u64;
        pub(super) fn ep_shim_normal_y_ready(r: u64, d: u64) -> u64;
        pub(super) fn ep_shim_normal_head(r: u64, p: u64, s: u64, e: u64) -> u64;
        pub(super) fn ep_shim_count_record_bytes() -> u64;
        pub(super) fn ep_shim_table_bytes(r: u64) -> u64;
        pub(super) fn ep_shim_normal_count_record(r: u64, p: u64, s: u64) -> u64;
        pub(super) fn ep_shim_count_record_channel(c: u64) -> u64;
        pub(super) fn ep_shim_count_record_experts() -> u64;
        pub(super) fn ep_shim_table_recv_begin(r: u64) -> u64;
        pub(super) fn ep_shim_row_scales_offset(h: u64, e: u64) -> u64;
        pub(super) fn ep_shim_normal_table(r: u64, p: u64) -> u64;
        pub(super) fn ep_shim_normal_rows_base(r: u64) -> u64;
        pub(super) fn ep_shim_normal_half(r: u64, b: u64) -> u64;
        pub(super) fn ep_shim_normal_dispatch_row(r: u64, row: u64, drec: u64) -> u64;
        pub(super) fn ep_shim_normal_combine_row(r: u64, b: u64, row: u64, yrec: u64) -> u64;
        pub(super) fn ep_shim_row_dispatch_record(h: u64, e: u64, s: u64, k: u64) -> u64;
        pub(super) fn ep_shim_row_meta_offset(h: u64, e: u64, s: u64) -> u64;
        pub(super) fn ep_shim_row_topk_idx_offset(h: u64, e: u64, s: u64) -> u64;
        pub(super) fn ep_shim_row_topk_weights_offset(h: u64, e: u64, s: u64, k: u64) -> u64;
        pub(super) fn ep_shim_row_combine_record(h: u64, k: u64) -> u64;
        pub(super) fn ep_shim_normal_final_row(a: u32, b: u32, c: u32) -> u32;
        pub(super) fn ep_shim_ll_signal_bytes(r: u64) -> u64;
        pub(super) fn ep_shim_ll_dispatch_signal(r: u64, h: u64, s: u64, b: u64) -> u64;
        pub(super) fn ep_shim_ll_combine_signal(r: u64, h: u64, d: u64, b: u64) -> u64;
        pub(super) fn ep_shim_ll_half(op: u64) -> u64;
        pub(super) fn ep_shim_ll_data_qp(run: u32, nq: u16) -> u16;
        pub(super) fn ep_shim_ll_row(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_meta(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_header_copy(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_header(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_header_copy_at(r: u64, l: u64, h: u64, n: u64, b: u64) -> u64;
        pub(super) fn ep_shim_ll_dsend_row(r: u64, l: u64, h: u64, n: u64, t: u64) -> u64;
        pub(super) fn ep_shim_ll_dsend_meta(r: u64, l: u64, h: u64, n: u64, d: u64) -> u64;
        pub(super) fn ep_shim_ll_drecv(r: u64, l: u64, h: u64, n: u64, s: u64) -> u64;
        pub(super) fn ep_shim_ll_drecv_row(r: u64, l: u64, h: u64, n: u64, s: u64, i: u64) -> u64;
        pub(super) fn ep_shim_ll_csend(r: u64, l: u64, h: u64, n: u64, s: u64, i: u64) -> u64;
        pub(super) fn ep_shim_ll_crecv(r: u64, l: u64, h: u64, n: u64, d: u64, i: u64) -> u64;
        pub(super) fn ep_shim_ll_cy(r: u64, l: u64, h: u64, n: u64, e: u64, row: u64) -> u64;
        pub(super) fn ep_shim_ll_logfmt_meta(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_csend_meta(r: u64, l: u64, h: u64, n: u64, s: u64, i: u64) -> u64;
        pub(super) fn ep_shim_ll_crecv_meta(r: u64, l: u64, h: u64, n: u64, d: u64, i: u64) -> u64;
        pub(super) fn ep_shim_ll_half_bytes(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_total_bytes(r: u64, l: u64, h: u64, n: u64) -> u64;
        pub(super) fn ep_shim_ll_meta_entry(l: u16, pos: u16, w: u32) -> u64;
        pub(super) fn ep_shim_ll_entry_expert(e: u64) -> u32;
        pub(super) fn ep_shim_ll_entry_pos(e: u64) -> u32;
        pub(super) fn ep_shim_ll_entry_weight_bits(e: u64) -> u32;
        pub(super) fn ep_shim_ll_meta_head(t: u32, n: u32) -> u64;
        pub(super) fn ep_shim_ll_head_token(h: u64) -> u32;
        pub(super) fn ep_shim_ll_head_count(h: u64) -> u32;
        pub(super) fn ep_shim_pack_layout_range(b: u32, c: u32) -> i64;
        pub(super) fn ep_shim_layout_range_begin(v: i64) -> u32;
        pub(super) fn ep_shim_layout_range_count(v: i64) -> u32;
    }
}

/// Wraps a call to a shim function taking and returning plain integers.
macro_rules! rule {
    ($(#[$m:meta])* $name:ident => $ffi:ident($($a:ident: $t:ty),*) -> $r:ty) => {
        $(#[$m])*
        #[must_use]
        pub fn $name($($a: $t),*) -> $r {
            // SAFETY: the shim function takes integers by value and returns an integer; it reads
            // and writes no memory (pure arithmetic of ep_protocol.cuh).
            unsafe { ffi::$ffi($($a),*) }
        }
    };
}

rule!(/// `ep_align16`.
    align16 => ep_shim_align16(x: u64) -> u64);
rule!(/// `ep_align128`.
    align128 => ep_shim_align128(x: u64) -> u64);
rule!(/// `ep_parity`.
    parity => ep_shim_parity(call: u64) -> u64);
rule!(/// `ep_epoch_word`.
    epoch_word => ep_shim_epoch_word(call: u64) -> u64);
rule!(/// `ep_counted`.
    counted => ep_shim_counted(call: u64, count: u32) -> u64);
rule!(/// `ep_ll_encode`.
    ll_encode => ep_shim_ll_encode(call: u64, count: u32) -> u64);
rule!(/// `ep_ll_threshold`.
    ll_threshold => ep_shim_ll_threshold(call: u64) -> u64);
rule!(/// `ep_ll_epoch`.
    ll_epoch => ep_shim_ll_epoch(v: u64) -> u64);
rule!(/// `ep_ll_count`.
    ll_count => ep_shim_ll_count(v: u64) -> u32);
rule!(/// `ep_normal_ctrl_bytes`.
    normal_ctrl_bytes => ep_shim_normal_ctrl_bytes(r: u64) -> u64);
rule!(/// `ep_normal_notify`.
    normal_notify => ep_shim_normal_notify(r: u64, p: u64, s: u64) -> u64);
rule!(/// `ep_normal_table_ready`.
    normal_table_ready => ep_shim_normal_table_ready(r: u64, p: u64) -> u64);
rule!(/// `ep_normal_done`.
    normal_done => ep_shim_normal_done(r: u64, s: u64, c: u64, h: u64) -> u64);
rule!(/// `ep_normal_pulled`.
    normal_pulled => ep_shim_normal_pulled(r: u64, s: u64, c: u64) -> u64);
rule!(/// `ep_normal_ready`.
    normal_ready => ep_shim_normal_ready(r: u64, d: u64) -> u64);
rule!(/// `ep_normal_y_ready`.
    normal_y_ready => ep_shim_normal_y_ready(r: u64, d: u64) -> u64);
rule!(/// `ep_normal_head`.
    normal_head => ep_shim_normal_head(r: u64, p: u64, s: u64, e: u64) -> u64);
rule!(/// `ep_count_record_bytes`.
    count_record_bytes => ep_shim_count_record_bytes() -> u64);
rule!(/// `ep_table_bytes`.
    table_bytes => ep_shim_table_bytes(r: u64) -> u64);
rule!(/// `ep_normal_count_record`.
    normal_count_record => ep_shim_normal_count_record(r: u64, p: u64, s: u64) -> u64);
rule!(/// `ep_count_record_channel`.
    count_record_channel => ep_shim_count_record_channel(c: u64) -> u64);
rule!(/// `ep_count_record_experts`.
    count_record_experts => ep_shim_count_record_experts() -> u64);
rule!(/// `ep_table_recv_begin`.
    table_recv_begin => ep_shim_table_recv_begin(r: u64) -> u64);
rule!(/// `ep_row_scales_offset`.
    row_scales_offset => ep_shim_row_scales_offset(hidden: u64, elem: u64) -> u64);
rule!(/// `ep_normal_table`.
    normal_table => ep_shim_normal_table(r: u64, p: u64) -> u64);
rule!(/// `ep_normal_rows_base`.
    normal_rows_base => ep_shim_normal_rows_base(r: u64) -> u64);
rule!(/// `ep_normal_half`.
    normal_half => ep_shim_normal_half(r: u64, data_bytes: u64) -> u64);
rule!(/// `ep_normal_dispatch_row`.
    normal_dispatch_row => ep_shim_normal_dispatch_row(r: u64, row: u64, drec: u64) -> u64);
rule!(/// `ep_normal_combine_row`.
    normal_combine_row => ep_shim_normal_combine_row(r: u64, data_bytes: u64, row: u64, yrec: u64) -> u64);
rule!(/// `ep_row_dispatch_record`.
    row_dispatch_record => ep_shim_row_dispatch_record(hidden: u64, elem: u64, scales: u64, k: u64) -> u64);
rule!(/// `ep_row_meta_offset`.
    row_meta_offset => ep_shim_row_meta_offset(hidden: u64, elem: u64, scales: u64) -> u64);
rule!(/// `ep_row_topk_idx_offset`.
    row_topk_idx_offset => ep_shim_row_topk_idx_offset(hidden: u64, elem: u64, scales: u64) -> u64);
rule!(/// `ep_row_topk_weights_offset`.
    row_topk_weights_offset => ep_shim_row_topk_weights_offset(hidden: u64, elem: u64, scales: u64, k: u64) -> u64);
rule!(/// `ep_row_combine_record`.
    row_combine_record => ep_shim_row_combine_record(hidden: u64, k: u64) -> u64);
rule!(/// `ep_normal_final_row`.
    normal_final_row => ep_shim_normal_final_row(begin: u32, start: u32, index: u32) -> u32);
rule!(/// `ep_ll_signal_bytes`.
    ll_signal_bytes => ep_shim_ll_signal_bytes(r: u64) -> u64);
rule!(/// `ep_ll_dispatch_signal`.
    ll_dispatch_signal => ep_shim_ll_dispatch_signal(r: u64, half: u64, s: u64, b: u64) -> u64);
rule!(/// `ep_ll_combine_signal`.
    ll_combine_signal => ep_shim_ll_combine_signal(r: u64, half: u64, d: u64, b: u64) -> u64);
rule!(/// `ep_ll_half`.
    ll_half => ep_shim_ll_half(op: u64) -> u64);
rule!(/// `ep_ll_data_qp`.
    ll_data_qp => ep_shim_ll_data_qp(run: u32, num_qps: u16) -> u16);
rule!(/// `ep_ll_meta_entry`: `(l, pos, w bits)` as the little-endian u64 of the 8 entry bytes.
    ll_meta_entry => ep_shim_ll_meta_entry(l: u16, pos: u16, w_bits: u32) -> u64);
rule!(/// `ep_ll_entry_expert`: the local expert of an entry.
    ll_entry_expert => ep_shim_ll_entry_expert(entry: u64) -> u32);
rule!(/// `ep_ll_entry_pos`: the row of an entry within its block.
    ll_entry_pos => ep_shim_ll_entry_pos(entry: u64) -> u32);
rule!(/// `ep_ll_entry_weight_bits`: the weight's f32 bits.
    ll_entry_weight_bits => ep_shim_ll_entry_weight_bits(entry: u64) -> u32);
rule!(/// `ep_ll_meta_head`: `(t, n)` as the little-endian u64 of a meta record's first 8 bytes.
    ll_meta_head => ep_shim_ll_meta_head(t: u32, n: u32) -> u64);
rule!(/// `ep_ll_head_token`.
    ll_head_token => ep_shim_ll_head_token(head: u64) -> u32);
rule!(/// `ep_ll_head_count`.
    ll_head_count => ep_shim_ll_head_count(head: u64) -> u32);
rule!(/// `ep_pack_layout_range`.
    pack_layout_range => ep_shim_pack_layout_range(begin: u32, count: u32) -> i64);
rule!(/// `ep_layout_range_begin`.
    layout_range_begin => ep_shim_layout_range_begin(value: i64) -> u32);
rule!(/// `ep_layout_range_count`.
    layout_range_count => ep_shim_layout_range_count(value: i64) -> u32);

/// `ep_channel_range`: `(start, end)`. `num_channels` must be at least 1.
#[must_use]
pub fn channel_range(num_tokens: u64, num_channels: u64, channel: u64) -> (u64, u64) {
    let (mut s, mut e) = (0u64, 0u64);
    // SAFETY: `s` and `e` are valid, exclusive u64 locations for the duration of the call; the
    // shim writes each once and keeps no pointer.
    unsafe { ffi::ep_shim_channel_range(num_tokens, num_channels.max(1), channel, &mut s, &mut e) };
    (s, e)
}

/// `ep_ll_send_group`: `(start, end)` of send group `b` of `groups` (at least 1).
#[must_use]
pub fn ll_send_group(num_tokens: u64, groups: u64, b: u64) -> (u64, u64) {
    let (mut s, mut e) = (0u64, 0u64);
    // SAFETY: `s` and `e` are valid, exclusive u64 locations for the duration of the call; the
    // shim writes each once and keeps no pointer.
    unsafe { ffi::ep_shim_ll_send_group(num_tokens, groups.max(1), b, &mut s, &mut e) };
    (s, e)
}

/// `ep_channel_half`: `(start, end)` of half `h`. `num_channels` must be at least 1.
#[must_use]
pub fn channel_half(num_tokens: u64, num_channels: u64, channel: u64, h: u64) -> (u64, u64) {
    let (mut s, mut e) = (0u64, 0u64);
    // SAFETY: `s` and `e` are valid, exclusive u64 locations for the duration of the call; the
    // shim writes each once and keeps no pointer.
    unsafe {
        ffi::ep_shim_channel_half(num_tokens, num_channels.max(1), channel, h, &mut s, &mut e)
    };
    (s, e)
}

/// Wraps a shim function taking an `ep_ll_layout` and integers.
macro_rules! ll_rule {
    ($(#[$m:meta])* $name:ident => $ffi:ident($($a:ident),*)) => {
        $(#[$m])*
        #[must_use]
        pub fn $name(l: LlDims $(, $a: u64)*) -> u64 {
            // SAFETY: integers by value, integer result, no memory touched (pure arithmetic).
            unsafe { ffi::$ffi(l.num_ranks, l.num_local_experts, l.hidden, l.num_max_tokens $(, $a)*) }
        }
    };
}

ll_rule!(/// `ep_ll_row`.
    ll_row => ep_shim_ll_row());
ll_rule!(/// `ep_ll_meta`.
    ll_meta => ep_shim_ll_meta());
ll_rule!(/// `ep_ll_header_copy`.
    ll_header_copy => ep_shim_ll_header_copy());
ll_rule!(/// `ep_ll_header`.
    ll_header => ep_shim_ll_header());
ll_rule!(/// `ep_ll_header_copy_at`.
    ll_header_copy_at => ep_shim_ll_header_copy_at(b));
ll_rule!(/// `ep_ll_dsend_row`.
    ll_dsend_row => ep_shim_ll_dsend_row(t));
ll_rule!(/// `ep_ll_dsend_meta`.
    ll_dsend_meta => ep_shim_ll_dsend_meta(d));
ll_rule!(/// `ep_ll_drecv`.
    ll_drecv => ep_shim_ll_drecv(s));
ll_rule!(/// `ep_ll_drecv_row`.
    ll_drecv_row => ep_shim_ll_drecv_row(s, i));
ll_rule!(/// `ep_ll_csend`.
    ll_csend => ep_shim_ll_csend(s, i));
ll_rule!(/// `ep_ll_crecv`.
    ll_crecv => ep_shim_ll_crecv(d, i));
ll_rule!(/// `ep_ll_cy`.
    ll_cy => ep_shim_ll_cy(e, row));
ll_rule!(/// `ep_ll_logfmt_meta`.
    ll_logfmt_meta => ep_shim_ll_logfmt_meta());
ll_rule!(/// `ep_ll_csend_meta`.
    ll_csend_meta => ep_shim_ll_csend_meta(s, i));
ll_rule!(/// `ep_ll_crecv_meta`.
    ll_crecv_meta => ep_shim_ll_crecv_meta(d, i));
ll_rule!(/// `ep_ll_half_bytes`.
    ll_half_bytes => ep_shim_ll_half_bytes());
ll_rule!(/// `ep_ll_total_bytes`.
    ll_total_bytes => ep_shim_ll_total_bytes());
