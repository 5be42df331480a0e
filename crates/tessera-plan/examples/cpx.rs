// scratch experiment (not committed)
use tessera_plan::cp_sim::{doc_causal_plan, doc_mix, DocMix};
use tessera_plan::{shard, CostModel, Scheme};
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let seeds: u64 = args.get(1).map(|s| s.parse().unwrap()).unwrap_or(10);
    let len = 512 * 1024;
    let r = 8;
    for seed in std::env::var("SEED0").map(|s| s.parse().unwrap()).unwrap_or(0)..seeds {
        let mix = DocMix::web(seed);
        let ids = doc_mix(len, &mix).unwrap();
        let mut lens = vec![];
        let mut cur = 1; 
        for i in 1..ids.len() { if ids[i] == ids[i-1] { cur += 1 } else { lens.push(cur); cur = 1 } }
        lens.push(cur);
        let long: Vec<usize> = lens.iter().copied().filter(|&l| l >= 32768).map(|l| l / 1024).collect();
        let p = doc_causal_plan(len, &mix, 128).unwrap();
        let mut line = format!("seed {seed:2} docs {:4} long {:?}", lens.len(), long);
        for scheme in Scheme::ALL {
            let t0 = Instant::now();
            let s = shard(&p, r, scheme, CostModel::default()).unwrap();
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            let ag = (s.tiles - s.tiles_per_rank()) as f64;
            let mx = s.costs.iter().map(|c| c.kv_tiles_remote).max().unwrap() as f64 / ag;
            line += &format!(" | {} {:.3} {:.3} {:.1}ms", &scheme.name()[..3], s.imbalance(), mx, ms);
            if scheme == Scheme::Balanced && std::env::var("DETAIL").is_ok() { detail(&s); }
        }
        println!("{line}");
    }
}
#[allow(dead_code)]
pub fn detail(s: &tessera_plan::Sharding) {
    for (k, o) in s.owned.iter().enumerate() {
        let mut per: std::collections::BTreeMap<usize, (usize, u32, u32)> = Default::default();
        for &t in o {
            let c = s.clusters.iter().position(|&(a, b)| a <= t && t < b).unwrap();
            let (a, b) = s.clusters[c];
            if b - a < 200 { continue; }
            let e = per.entry(c).or_insert((0, u32::MAX, 0));
            e.0 += 1; e.1 = e.1.min(t - a); e.2 = e.2.max(t - a);
        }
        println!("rank {k}: remote {} load {:.3} long pieces {:?}", s.costs[k].kv_tiles_remote, s.costs[k].cost() / (s.costs.iter().map(|c| c.cost()).sum::<f64>() / s.costs.len() as f64), per.iter().map(|(c, v)| (s.clusters[*c].1 - s.clusters[*c].0, v.0, v.1, v.2)).collect::<Vec<_>>());
    }
}
