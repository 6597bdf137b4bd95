//! The CUDA header `include/ep_protocol.cuh` (compiled for the host by build.rs) computes every
//! per-token rule exactly as `ep_core::protocol` does: property tests through FFI, no GPU.

use ep_core::plan::low_latency::{pack_layout_range, unpack_layout_range};
use ep_core::protocol::layout as l;
use ep_core::protocol::signal as sig;
use ep_kernels::rules as c;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
        .max(256)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn common_and_signals(x in 0u64..1 << 40, t in 0usize..5000, ch in 1usize..64, i in 0usize..64,
                          call in 0u64..1 << 31, count in any::<u32>(), v in any::<u64>()) {
        prop_assert_eq!(c::align16(x), l::align16(x));
        prop_assert_eq!(c::align128(x), l::align128(x));
        let r = l::channel_range(t, ch, i);
        prop_assert_eq!(c::channel_range(t as u64, ch as u64, i as u64), (r.start as u64, r.end as u64));
        let g = l::ll_send_group(t, ch, i);
        prop_assert_eq!(c::ll_send_group(t as u64, ch as u64, i as u64), (g.start as u64, g.end as u64));
        for h in 0..2 {
            let half = l::channel_half(t, ch, i, h);
            prop_assert_eq!(c::channel_half(t as u64, ch as u64, i as u64, h as u64), (half.start as u64, half.end as u64));
        }
        prop_assert_eq!(c::parity(call), l::parity(call));
        prop_assert_eq!(c::epoch_word(call), sig::epoch_word(call));
        prop_assert_eq!(c::counted(call, count), sig::counted(call, count));
        prop_assert_eq!(c::ll_encode(call, count), sig::ll_encode(call, count));
        prop_assert_eq!(c::ll_threshold(call), sig::ll_threshold(call));
        prop_assert_eq!(c::ll_epoch(v), sig::ll_epoch(v));
        prop_assert_eq!(c::ll_count(v), sig::ll_count(v));
    }

    #[test]
    fn normal_offsets(r in 1usize..=160, p in 0u64..2, s in 0usize..160, ch in 0usize..l::MAX_CHANNELS,
                      data in 0u64..1 << 34, row in 0u64..1 << 20, h in 1usize..9000, elem in 1usize..=2,
                      scales in 0usize..80, k in 0usize..=32, a in 0u32..1 << 20, b in 0u32..1 << 20, ix in 0u32..1 << 20) {
        let s = s % r;
        let ctrl = l::NormalCtrl { num_ranks: r };
        let ru = r as u64;
        prop_assert_eq!(c::normal_ctrl_bytes(ru), ctrl.bytes());
        prop_assert_eq!(c::normal_notify(ru, p, s as u64), ctrl.notify(p, s));
        prop_assert_eq!(c::normal_table_ready(ru, p), ctrl.table_ready(p));
        for h in 0..2 {
            prop_assert_eq!(c::normal_done(ru, s as u64, ch as u64, h as u64), ctrl.done(s, ch, h));
        }
        prop_assert_eq!(c::normal_pulled(ru, s as u64, ch as u64), ctrl.pulled(s, ch));
        prop_assert_eq!(c::normal_ready(ru, s as u64), ctrl.ready(s));
        prop_assert_eq!(c::normal_y_ready(ru, s as u64), ctrl.y_ready(s));
        for e in [0, s, r - 1] {
            prop_assert_eq!(c::normal_head(ru, p, s as u64, e as u64), ctrl.head(p, s, e));
        }
        let d = l::NormalData { num_ranks: r, data_bytes: data };
        prop_assert_eq!(c::count_record_bytes(), l::count_record_bytes());
        prop_assert_eq!(c::table_bytes(ru), l::table_bytes(r));
        prop_assert_eq!(c::normal_count_record(ru, p, s as u64), d.count_record(p, s));
        prop_assert_eq!(c::normal_table(ru, p), d.table(p));
        let (crec_cpm, crec_e) = l::count_record_fields();
        prop_assert_eq!((c::count_record_channel(0), c::count_record_experts()), (crec_cpm, crec_e));
        for ch in [0usize, 1, 7, 63] {
            prop_assert_eq!(c::count_record_channel(ch as u64), l::count_record_channel(ch));
        }
        let (tab_send, tab_begin) = l::table_fields(r);
        prop_assert_eq!((0, c::table_recv_begin(ru)), (tab_send, tab_begin));
        prop_assert_eq!(c::normal_rows_base(ru), d.rows_base());
        prop_assert_eq!(c::normal_half(ru, data), d.half());
        let f = l::RowFormat { hidden: h, elem_bytes: elem, num_scales: scales, num_topk: k };
        let (hu, eu, su, ku) = (h as u64, elem as u64, scales as u64, k as u64);
        prop_assert_eq!(c::row_dispatch_record(hu, eu, su, ku), f.dispatch_record());
        prop_assert_eq!(c::row_meta_offset(hu, eu, su), f.meta_offset());
        prop_assert_eq!(c::row_scales_offset(hu, eu), f.scales_offset());
        prop_assert_eq!(c::row_topk_idx_offset(hu, eu, su), f.topk_idx_offset());
        prop_assert_eq!(c::row_topk_weights_offset(hu, eu, su, ku), f.topk_weights_offset());
        prop_assert_eq!(c::row_combine_record(hu, ku), f.combine_record());
        prop_assert_eq!(c::normal_dispatch_row(ru, row, f.dispatch_record()), d.dispatch_row(row, f.dispatch_record()));
        prop_assert_eq!(c::normal_combine_row(ru, data, row, f.combine_record()), d.combine_row(row, f.combine_record()));
        prop_assert_eq!(c::normal_final_row(a, b, ix), l::normal_final_row(a, b, ix));
    }

    #[test]
    fn low_latency_offsets(r in 1usize..=256, le in 1usize..=64, h128 in 1usize..=64, n in 1usize..=1024,
                           half in 0u64..2, s in 0usize..256, i in 0usize..1024, op in any::<u64>(),
                           run in any::<u32>(), nq in 0u16..64, ll in any::<u16>(), pos in any::<u16>(),
                           w in any::<f32>(), begin in any::<u32>(), count in any::<u32>(),
                           g in 0usize..l::LL_MAX_SEND_GROUPS) {
        let (s, i) = (s % r, i % n);
        let lay = l::LlLayout { num_ranks: r, num_local_experts: le, hidden: 128 * h128, num_max_tokens: n };
        let dims = c::LlDims { num_ranks: r as u64, num_local_experts: le as u64, hidden: lay.hidden as u64, num_max_tokens: n as u64 };
        let (su, iu) = (s as u64, i as u64);
        prop_assert_eq!(c::ll_signal_bytes(r as u64), l::ll_signal_bytes(r));
        prop_assert_eq!(c::ll_dispatch_signal(r as u64, half, su, g as u64), l::ll_dispatch_signal(r, half, s, g));
        prop_assert_eq!(c::ll_header_copy(dims), lay.header_copy());
        prop_assert_eq!(c::ll_header(dims), lay.header());
        prop_assert_eq!(c::ll_header_copy_at(dims, g as u64), lay.header_copy_at(g));
        prop_assert_eq!(c::ll_combine_signal(r as u64, half, su, g as u64), l::ll_combine_signal(r, half, s, g));
        prop_assert_eq!(c::ll_half(op), l::ll_half(op));
        prop_assert_eq!(c::ll_data_qp(run, nq), l::ll_data_qp(run, nq));
        prop_assert_eq!(c::ll_row(dims), lay.row());
        prop_assert_eq!(c::ll_meta(dims), lay.meta());
        prop_assert_eq!(c::ll_dsend_row(dims, iu), lay.dsend_row(i));
        prop_assert_eq!(c::ll_dsend_meta(dims, su), lay.dsend_meta(s));
        prop_assert_eq!(c::ll_drecv(dims, su), lay.drecv(s));
        prop_assert_eq!(c::ll_drecv_row(dims, su, iu), lay.drecv_row(s, i));
        prop_assert_eq!(c::ll_csend(dims, su, iu), lay.csend(s, i));
        prop_assert_eq!(c::ll_crecv(dims, su, iu), lay.crecv(s, i));
        prop_assert_eq!(c::ll_cy(dims, (s % le) as u64, iu), lay.cy(s % le, i));
        prop_assert_eq!(c::ll_logfmt_meta(dims), lay.logfmt_meta());
        prop_assert_eq!(c::ll_csend_meta(dims, su, iu), lay.csend_meta(s, i));
        prop_assert_eq!(c::ll_crecv_meta(dims, su, iu), lay.crecv_meta(s, i));
        prop_assert_eq!(c::ll_half_bytes(dims), lay.half_bytes());
        prop_assert_eq!(c::ll_total_bytes(dims), lay.total_bytes());
        prop_assert_eq!(c::ll_meta_entry(ll, pos, w.to_bits()).to_le_bytes(), l::ll_meta_entry(ll, pos, w));
        let e = u64::from_le_bytes(l::ll_meta_entry(ll, pos, w));
        let (dl, dpos, dw) = l::ll_meta_entry_decode(&e.to_le_bytes());
        prop_assert_eq!((c::ll_entry_expert(e), c::ll_entry_pos(e)), (u32::from(dl), u32::from(dpos)));
        prop_assert_eq!(c::ll_entry_weight_bits(e), dw.to_bits());
        let (ht, hn) = (begin, count);
        prop_assert_eq!(c::ll_meta_head(ht, hn).to_le_bytes(), l::ll_meta_head(ht, hn));
        let head = u64::from_le_bytes(l::ll_meta_head(ht, hn));
        prop_assert_eq!((c::ll_head_token(head), c::ll_head_count(head)), l::ll_meta_head_decode(&head.to_le_bytes()));
        prop_assert_eq!(c::pack_layout_range(begin, count), pack_layout_range(begin, count));
        let packed = pack_layout_range(begin, count);
        prop_assert_eq!((c::layout_range_begin(packed), c::layout_range_count(packed)), unpack_layout_range(packed));
    }
}
