//! Context-parallel shardings from Python (docs/semantics.md#many-ranks): `shard(plan, world_size, scheme)` with the
//! GIL released, the per-rank tiles, positions, costs, needed K/V tiles and local plans as numpy
//! arrays and `Plan`s; and the `cp-sim` balance/traffic model.

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use tessera::plan::cp_sim::{self, DocMix, SimModel};
use tessera::{CostModel, KvLayout, Plan, Scheme, Sharding};

use crate::errors::to_py;
use crate::plan::PyPlan;

/// A sharding of a plan's row over ranks (made by `shard`).
#[pyclass(name = "Sharding", module = "tessera._tessera", frozen)]
pub struct PySharding {
    inner: Arc<Sharding>,
    plan: Arc<Plan>,
}

fn i64s(py: Python<'_>, v: impl IntoIterator<Item = usize>) -> Bound<'_, PyArray1<i64>> {
    v.into_iter()
        .map(|x| x as i64)
        .collect::<Vec<_>>()
        .into_pyarray(py)
}

/// Shards `plan` over `world_size` ranks with `scheme`.
#[pyfunction]
#[pyo3(signature = (plan, world_size, scheme="balanced", partial_overhead=0.3, backward=2.5, balance_cap=1.02))]
pub fn shard(
    py: Python<'_>,
    plan: PyRef<'_, PyPlan>,
    world_size: usize,
    scheme: &str,
    partial_overhead: f64,
    backward: f64,
    balance_cap: f64,
) -> PyResult<PySharding> {
    let scheme = Scheme::parse(scheme).map_err(to_py)?;
    let model = CostModel {
        partial_overhead,
        backward,
        balance_cap,
    };
    let p = plan.whole(py)?.clone();
    let s = py
        .detach(|| tessera::shard(&p, world_size, scheme, model))
        .map_err(to_py)?;
    Ok(PySharding {
        inner: Arc::new(s),
        plan: p,
    })
}

impl PySharding {
    fn rank(&self, rank: usize) -> PyResult<usize> {
        if rank >= self.inner.world_size {
            return Err(PyValueError::new_err(format!(
                "rank: expected a rank below world_size {}, got {rank}",
                self.inner.world_size
            )));
        }
        Ok(rank)
    }
}

#[pymethods]
impl PySharding {
    /// The scheme name.
    #[getter]
    fn scheme(&self) -> &'static str {
        self.inner.scheme.name()
    }
    /// `R`.
    #[getter]
    fn world_size(&self) -> usize {
        self.inner.world_size
    }
    /// Tile side in tokens.
    #[getter]
    fn tile(&self) -> usize {
        self.inner.tile
    }
    /// Tokens each rank owns.
    #[getter]
    fn tokens_per_rank(&self) -> usize {
        self.inner.tokens_per_rank()
    }
    /// Hex digest of plan contract, scheme, `R`, cost model and assignment.
    #[getter]
    fn fingerprint(&self) -> String {
        tessera::core::hex(&self.inner.fingerprint)
    }
    /// Largest over mean per-rank modelled cost.
    fn imbalance(&self) -> f64 {
        self.inner.imbalance()
    }
    /// The busiest receiver's K/V (needed mode) over an all-gather's.
    fn kv_fraction(&self) -> f64 {
        self.inner.kv_fraction()
    }
    /// The q tiles rank `rank` owns (global tile ids, ascending).
    fn owned<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let r = self.rank(rank)?;
        Ok(i64s(py, self.inner.owned[r].iter().map(|&t| t as usize)))
    }
    /// Rank `rank`'s token positions in local order.
    fn positions<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bound<'py, PyArray1<i64>>> {
        Ok(i64s(py, self.inner.positions(rank).map_err(to_py)?))
    }
    /// Every rank's positions, rank after rank (the sharded order).
    fn permutation<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        i64s(py, self.inner.permutation())
    }
    /// `needed(rank)[src]`: the K/V tiles rank `rank`'s rows touch that `src` owns.
    fn needed<'py>(
        &self,
        py: Python<'py>,
        rank: usize,
    ) -> PyResult<Vec<Bound<'py, PyArray1<i64>>>> {
        let r = self.rank(rank)?;
        Ok(self.inner.needed[r]
            .iter()
            .map(|v| i64s(py, v.iter().map(|&t| t as usize)))
            .collect())
    }
    /// Global K/V tiles of rank `rank`'s local K/V in `mode` (`allgather` or `needed`), in order.
    fn local_kv_tiles<'py>(
        &self,
        py: Python<'py>,
        rank: usize,
        mode: &str,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let layout = KvLayout::parse(mode).map_err(to_py)?;
        let v = self.inner.local_kv_tiles(rank, layout).map_err(to_py)?;
        Ok(i64s(py, v.into_iter().map(|t| t as usize)))
    }
    /// Rank `rank`'s local plan in `mode`, against at least `kv_tiles` local K/V tiles (padding
    /// past the rank's own; GIL released while it is built).
    #[pyo3(signature = (rank, mode, kv_tiles=0))]
    fn local_plan(
        &self,
        py: Python<'_>,
        rank: usize,
        mode: &str,
        kv_tiles: usize,
    ) -> PyResult<PyPlan> {
        let layout = KvLayout::parse(mode).map_err(to_py)?;
        let (s, p) = (self.inner.clone(), self.plan.clone());
        let lp = py
            .detach(|| s.local_plan_padded(&p, rank, layout, kv_tiles))
            .map_err(to_py)?;
        Ok(PyPlan::new(Arc::new(lp), None, "sharded"))
    }
    /// Clusters (runs of q tiles whose rows reach only each other) as `int64 [n, 2]` ranges.
    fn clusters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i64>>> {
        let c = &self.inner.clusters;
        let v: Vec<i64> = c.iter().flat_map(|&(a, b)| [a as i64, b as i64]).collect();
        v.into_pyarray(py).reshape([c.len(), 2])
    }
    /// Per rank: pairs, full/partial tiles, modelled forward/backward cost, needed and remote K/V
    /// tiles, remote K/V as a fraction of an all-gather.
    #[getter]
    fn costs<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .costs
            .iter()
            .map(|c| {
                let d = PyDict::new(py);
                d.set_item("pairs", c.pairs)?;
                d.set_item("full_tiles", c.full_tiles)?;
                d.set_item("partial_tiles", c.partial_tiles)?;
                d.set_item("forward_cost", c.forward_cost)?;
                d.set_item("backward_cost", c.backward_cost)?;
                d.set_item("kv_tiles_needed", c.kv_tiles_needed)?;
                d.set_item("kv_tiles_remote", c.kv_tiles_remote)?;
                d.set_item("kv_remote_fraction", c.kv_remote_fraction)?;
                Ok(d)
            })
            .collect()
    }
}

/// Segment ids of one packed row drawn from the cp-sim document mix.
#[pyfunction]
#[pyo3(signature = (length, seed=0, median=None, sigma=None, long_fraction=None, long_docs=None))]
pub fn doc_mix<'py>(
    py: Python<'py>,
    length: usize,
    seed: u64,
    median: Option<f64>,
    sigma: Option<f64>,
    long_fraction: Option<f64>,
    long_docs: Option<f64>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let d = DocMix::default();
    let mix = DocMix {
        seed,
        median: median.unwrap_or(d.median),
        sigma: sigma.unwrap_or(d.sigma),
        long_fraction: long_fraction.unwrap_or(d.long_fraction),
        long_docs: long_docs.unwrap_or(d.long_docs),
        ..d
    };
    if length == 0 {
        return Err(PyValueError::new_err(
            "length: expected a positive int, got 0",
        ));
    }
    let v = py.detach(|| cp_sim::doc_mix(length, &mix)).map_err(to_py)?;
    Ok(v.into_pyarray(py))
}

/// The cp-sim model: every scheme at every world size for the doc-causal row of each length.
/// Returns `(rows, assumptions)`.
#[pyfunction]
#[pyo3(signature = (lengths, ranks, seed=0, flops=400e12, link_gbps=50.0, heads=32, kv_heads=8, head_dim=128, tile=128, mix="tokens", balance_cap=1.02))]
#[allow(clippy::too_many_arguments)]
pub fn simulate<'py>(
    py: Python<'py>,
    lengths: Vec<usize>,
    ranks: Vec<usize>,
    seed: u64,
    flops: f64,
    link_gbps: f64,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    tile: usize,
    mix: &str,
    balance_cap: f64,
) -> PyResult<(Vec<Bound<'py, PyDict>>, Vec<String>)> {
    if !(flops.is_finite() && flops > 0.0 && link_gbps.is_finite() && link_gbps > 0.0) {
        return Err(PyValueError::new_err(
            "flops, link_gbps: expected finite positive numbers",
        ));
    }
    if heads == 0 || kv_heads == 0 || head_dim == 0 {
        return Err(PyValueError::new_err(
            "heads, kv_heads, head_dim: expected positive ints",
        ));
    }
    let model = SimModel {
        heads,
        kv_heads,
        head_dim,
        flops,
        link_bytes_per_s: link_gbps * 1e9,
        tile,
        cost: CostModel {
            balance_cap,
            ..CostModel::default()
        },
        ..SimModel::default()
    };
    let mix = match mix {
        "tokens" => DocMix {
            seed,
            ..DocMix::default()
        },
        "web" => DocMix::web(seed),
        _ => {
            return Err(PyValueError::new_err(format!(
                "mix: expected 'tokens' or 'web', got '{mix}'"
            )))
        }
    };
    let rows = py
        .detach(|| cp_sim::simulate(&lengths, &ranks, &mix, &model))
        .map_err(to_py)?;
    let out = rows
        .iter()
        .map(|r| {
            let d = PyDict::new(py);
            d.set_item("tokens", r.tokens)?;
            d.set_item("ranks", r.ranks)?;
            d.set_item("scheme", r.scheme.name())?;
            d.set_item("cost_max_over_mean", r.cost_max_over_mean)?;
            d.set_item("pairs_max_over_mean", r.pairs_max_over_mean)?;
            d.set_item("tiles_max_over_mean", r.tiles_max_over_mean)?;
            d.set_item("tiles_max", r.tiles_max)?;
            d.set_item("extra_tiles", r.extra_tiles)?;
            d.set_item("allgather_bytes", r.allgather_bytes)?;
            d.set_item("needed_bytes_max", r.needed_bytes_max)?;
            d.set_item("needed_bytes_mean", r.needed_bytes_mean)?;
            d.set_item("needed_fraction_max", r.needed_fraction_max)?;
            d.set_item("step_allgather_s", r.step_allgather_s)?;
            d.set_item("step_needed_s", r.step_needed_s)?;
            d.set_item("shard_ms", r.shard_ms)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    Ok((out, model.assumptions()))
}
