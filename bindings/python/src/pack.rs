//! Document packing from Python (docs/semantics.md#packing): the CLI's packer and verification over in-memory
//! token lists.

use numpy::{IntoPyArray, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tessera::pack::{pack_docs, PackConfig, Strategy};

use crate::errors::to_py;

/// Packs documents (lists of non-negative token ids) into `[rows, seq_len]` rows: returns a
/// dict with int32 numpy `tokens`, `segment_ids` (-1 = padding), `positions` and `stats`.
#[pyfunction]
#[pyo3(signature = (docs, seq_len, strategy="best-fit", bos=256))]
pub fn pack<'py>(
    py: Python<'py>,
    docs: Vec<Vec<i32>>,
    seq_len: usize,
    strategy: &str,
    bos: u32,
) -> PyResult<Bound<'py, PyDict>> {
    let strategy: Strategy = strategy.parse().map_err(to_py)?;
    let cfg = PackConfig {
        seq_len,
        strategy,
        bos,
    };
    let packed = py
        .detach(|| -> tessera::Result<_> {
            let p = pack_docs(&docs, &cfg)?;
            // The same verification as `tessera pack --verify`, on the arrays in memory.
            p.check(bos)?;
            Ok(p)
        })
        .map_err(to_py)?;
    let (rows, len) = (packed.rows, packed.seq_len);
    let d = PyDict::new(py);
    d.set_item(
        "tokens",
        packed.tokens.into_pyarray(py).reshape([rows, len])?,
    )?;
    d.set_item(
        "segment_ids",
        packed.segment_ids.into_pyarray(py).reshape([rows, len])?,
    )?;
    d.set_item(
        "positions",
        packed.positions.into_pyarray(py).reshape([rows, len])?,
    )?;
    let s = &packed.stats;
    let st = PyDict::new(py);
    st.set_item("rows", s.rows)?;
    st.set_item("seq_len", s.seq_len)?;
    st.set_item("documents", s.documents)?;
    st.set_item("pieces", s.pieces)?;
    st.set_item("tokens", s.tokens)?;
    st.set_item("padding_tokens", s.padding_tokens)?;
    st.set_item("padding_pct", s.padding_pct)?;
    st.set_item("split_documents", s.split_documents)?;
    st.set_item("empty_documents_skipped", s.empty_documents_skipped)?;
    st.set_item("summary", s.summary())?;
    d.set_item("stats", st)?;
    Ok(d)
}
