//! Export timing on a long-context plan: 128K tokens, causal within documents of ~1K tokens,
//! tile 128x128. Ignored by default; run with
//!
//! `cargo test --release -p tessera-export --test export_timing -- --ignored --nocapture`

use std::time::Instant;
use tessera_export::{flex, splash};
use tessera_mask::{Mask, SegmentIds, Segments};
use tessera_plan::{build_plan, PlanShape, TileShape};

fn best_of<T>(n: usize, mut f: impl FnMut() -> T) -> (f64, T) {
    let mut best = f64::INFINITY;
    let mut out = None;
    for _ in 0..n {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed().as_secs_f64() * 1e3);
        out = Some(v);
    }
    (best, out.expect("n > 0"))
}

#[test]
#[ignore]
fn export_128k_documents_causal() {
    let len = 128 * 1024;
    // Document lengths 512..1535 (mean ~1K), deterministic.
    let mut ids = Vec::with_capacity(len);
    let (mut doc, mut x) = (0i64, 0x2545_f491_4f6c_dd1du64);
    while ids.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let n = 512 + (x % 1024) as usize;
        ids.extend(std::iter::repeat_n(doc, n.min(len - ids.len())));
        doc += 1;
    }
    let mask = Mask::causal() & Mask::document(Segments::shared(SegmentIds::shared(ids).unwrap()));
    let t = Instant::now();
    let plan = build_plan(
        &mask,
        PlanShape::new(1, 1, len, len).unwrap(),
        TileShape::new(128, 128).unwrap(),
    )
    .unwrap();
    let plan_ms = t.elapsed().as_secs_f64() * 1e3;
    let dir = tempfile::tempdir().unwrap();

    let (s_ms, s) = best_of(5, || splash::export(&plan).unwrap());
    let sp = dir.path().join("splash.npz");
    let (sw_ms, _) = best_of(3, || s.write_npz(&sp).unwrap());
    let (f_ms, f) = best_of(5, || flex::export(&plan).unwrap());
    let fp = dir.path().join("flex.npz");
    let (fw_ms, _) = best_of(3, || f.write_npz(&fp).unwrap());

    let fwd = &s.rows[0].fwd;
    println!(
        "128K causal&document ({doc} documents), tile 128x128: {} x {} tiles, {} active, {} unique partial",
        plan.q_tiles,
        plan.kv_tiles,
        plan.stats.partial_tiles + plan.stats.full_tiles,
        plan.stats.unique_partial_masks
    );
    println!("plan build            {plan_ms:9.2} ms");
    println!(
        "splash export         {s_ms:9.2} ms   (block_mask {:?} {}, {} partial blocks)",
        fwd.block_mask.shape,
        fwd.block_mask.dtype.name(),
        fwd.partial_mask_blocks.as_ref().map_or(0, |p| p.shape[0])
    );
    println!(
        "splash write_npz      {sw_ms:9.2} ms   ({:.1} MB)",
        std::fs::metadata(&sp).unwrap().len() as f64 / 1e6
    );
    println!(
        "flex export           {f_ms:9.2} ms   (kv_indices [1, 1, {}, {}] int32)",
        f.blocks.0, f.blocks.1
    );
    println!(
        "flex write_npz        {fw_ms:9.2} ms   ({:.1} MB)",
        std::fs::metadata(&fp).unwrap().len() as f64 / 1e6
    );
}
