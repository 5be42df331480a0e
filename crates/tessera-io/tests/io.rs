//! Round trips and bad-input errors for tensor files.

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use tessera_core::{DType, Error, Tensor, TensorData};
use tessera_io::{
    atomic_create_bytes, atomic_write, read_safetensors, read_tensor, write_safetensors,
    write_tensor,
};

fn sample(dtype: DType, shape: &[usize], seed: u64) -> Tensor {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let data = match dtype {
        DType::F32 => TensorData::F32((0..n).map(|_| rng.gen_range(-4.0..4.0)).collect()),
        DType::BF16 => TensorData::BF16(
            (0..n)
                .map(|_| bf16::from_f32(rng.gen_range(-4.0..4.0)))
                .collect(),
        ),
        DType::F16 => TensorData::F16(
            (0..n)
                .map(|_| f16::from_f32(rng.gen_range(-4.0..4.0)))
                .collect(),
        ),
        DType::I8 => TensorData::I8((0..n).map(|_| rng.gen()).collect()),
        DType::U8 => TensorData::U8((0..n).map(|_| rng.gen()).collect()),
        DType::Bool => TensorData::Bool((0..n).map(|_| rng.gen()).collect()),
        DType::I32 => TensorData::I32((0..n).map(|_| rng.gen()).collect()),
        DType::I64 => TensorData::I64((0..n).map(|_| rng.gen()).collect()),
    };
    Tensor::new(shape.to_vec(), data).unwrap()
}

const ALL: [DType; 8] = [
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::I8,
    DType::U8,
    DType::Bool,
    DType::I32,
    DType::I64,
];

fn spec(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

fn is_format(e: &Error) -> bool {
    matches!(e, Error::Format { .. })
}

fn is_invalid(e: &Error) -> bool {
    matches!(e, Error::InvalidArgument { .. })
}

#[test]
fn round_trip_every_dtype_both_formats() {
    let dir = tempfile::tempdir().unwrap();
    for (i, dt) in ALL.into_iter().enumerate() {
        for shape in [vec![2, 3, 5], vec![7], vec![], vec![0, 4]] {
            let t = sample(dt, &shape, i as u64);
            for ext in ["npy", "safetensors"] {
                let p = dir.path().join(format!("t_{dt}_{}.{ext}", shape.len()));
                write_tensor(&p, &t).unwrap();
                // npy bf16 is raw <u2 bits: it reads back only with an explicit bf16 dtype.
                let back = read_tensor(&spec(&p), Some(dt)).unwrap();
                assert_eq!(back, t, "{dt} {shape:?} {ext}");
                if !(dt == DType::BF16 && ext == "npy") {
                    assert_eq!(read_tensor(&spec(&p), None).unwrap(), t);
                }
            }
        }
    }
}

#[test]
fn npy_u2_needs_explicit_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("b.npy");
    write_tensor(&p, &sample(DType::BF16, &[4], 1)).unwrap();
    let e = read_tensor(&spec(&p), None).unwrap_err();
    assert!(
        is_format(&e) && e.to_string().contains("--dtype bf16"),
        "{e}"
    );
    let e = read_tensor(&spec(&p), Some(DType::F16)).unwrap_err();
    assert!(e.to_string().contains("--dtype bf16"), "{e}");
}

#[test]
fn f64_is_narrowed_to_f32() {
    let dir = tempfile::tempdir().unwrap();
    let vals = [1.5f64, -2.25, 1e-3];
    let p = dir.path().join("d.npy");
    npyz::to_file_1d(&p, vals.iter().copied()).unwrap();
    let t = read_tensor(&spec(&p), Some(DType::F32)).unwrap();
    assert_eq!(t.to_f32_vec().unwrap(), vec![1.5f32, -2.25, 1e-3]);

    let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![3], &bytes).unwrap();
    let st = safetensors::serialize([("x", view)], &None).unwrap();
    let p = dir.path().join("d.safetensors");
    std::fs::write(&p, st).unwrap();
    let t = read_tensor(&spec(&p), None).unwrap();
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(t.to_f32_vec().unwrap(), vec![1.5f32, -2.25, 1e-3]);
}

#[test]
fn safetensors_name_selection() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.safetensors");
    let a = sample(DType::F32, &[2, 2], 1);
    let b = sample(DType::I32, &[3], 2);
    write_safetensors(&p, &[("b", &b), ("a", &a)]).unwrap();
    assert_eq!(read_tensor(&format!("{}:a", spec(&p)), None).unwrap(), a);
    assert_eq!(read_tensor(&format!("{}:b", spec(&p)), None).unwrap(), b);

    let all = read_safetensors(&p).unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!((all[0].0.as_str(), &all[0].1), ("a", &a));
    assert_eq!((all[1].0.as_str(), &all[1].1), ("b", &b));

    let e = read_tensor(&spec(&p), None).unwrap_err();
    assert!(is_invalid(&e) && e.to_string().contains("a, b"), "{e}");
    let e = read_tensor(&format!("{}:zzz", spec(&p)), None).unwrap_err();
    assert!(
        is_invalid(&e) && e.to_string().contains("zzz") && e.to_string().contains("a, b"),
        "{e}"
    );
    let e = read_tensor(&format!("{}:", spec(&p)), None).unwrap_err();
    assert!(is_invalid(&e), "{e}");

    // A single tensor needs no name; write_tensor names it "tensor".
    let q = dir.path().join("one.safetensors");
    write_tensor(&q, &a).unwrap();
    assert_eq!(read_tensor(&spec(&q), None).unwrap(), a);
    assert_eq!(
        read_tensor(&format!("{}:tensor", spec(&q)), None).unwrap(),
        a
    );

    let e = write_safetensors(&q, &[("x", &a), ("x", &b)]).unwrap_err();
    assert!(is_invalid(&e), "{e}");
    assert_eq!(
        read_tensor(&spec(&q), None).unwrap(),
        a,
        "failed write kept the old file"
    );
}

#[test]
fn paths_with_colons_and_npy_names() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a:b.npy");
    let t = sample(DType::I64, &[3], 3);
    write_tensor(&p, &t).unwrap();
    assert_eq!(read_tensor(&spec(&p), None).unwrap(), t);
    let e = read_tensor(&format!("{}:x", spec(&p)), None).unwrap_err();
    assert!(is_invalid(&e), "{e}");
}

#[test]
fn missing_file_wrong_extension() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["nope.npy", "nope.safetensors"] {
        let e = read_tensor(&spec(&dir.path().join(name)), None).unwrap_err();
        assert!(matches!(e, Error::Io { .. }), "{e}");
    }
    let e = read_tensor(
        &format!("{}:x", spec(&dir.path().join("nope.safetensors"))),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");

    let p = dir.path().join("t.txt");
    std::fs::write(&p, b"hello").unwrap();
    let e = read_tensor(&spec(&p), None).unwrap_err();
    assert!(is_invalid(&e) && e.to_string().contains(".npy"), "{e}");
    let e = write_tensor(&dir.path().join("o.bin"), &sample(DType::F32, &[1], 0)).unwrap_err();
    assert!(is_invalid(&e), "{e}");
    assert!(!dir.path().join("o.bin").exists());
}

#[test]
fn malformed_and_truncated_files() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for ext in ["npy", "safetensors"] {
        // Random bytes, including ones that start with a valid magic string.
        for k in 0..50 {
            let n = rng.gen_range(0..300);
            let mut bytes: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if ext == "npy" && k % 2 == 0 && bytes.len() > 10 {
                bytes[..6].copy_from_slice(b"\x93NUMPY");
                bytes[6] = 1;
            }
            let p = dir.path().join(format!("r{k}.{ext}"));
            std::fs::write(&p, &bytes).unwrap();
            let e = read_tensor(&spec(&p), None).unwrap_err();
            assert!(is_format(&e), "{ext}: {e}");
        }
        // Every proper prefix of a valid file is rejected.
        let p = dir.path().join(format!("ok.{ext}"));
        write_tensor(&p, &sample(DType::F32, &[3, 4], 1)).unwrap();
        let full = std::fs::read(&p).unwrap();
        for cut in 0..full.len() {
            let q = dir.path().join(format!("cut.{ext}"));
            std::fs::write(&q, &full[..cut]).unwrap();
            let e = read_tensor(&spec(&q), None).unwrap_err();
            assert!(is_format(&e), "{ext} cut at {cut}: {e}");
        }
    }
}

/// Builds an npy file with a hand-written header dictionary.
fn raw_npy(dict: &str, data: &[u8]) -> Vec<u8> {
    let mut h = dict.to_string();
    while (10 + h.len() + 1) & 63 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((h.len() as u16).to_le_bytes());
    out.extend(h.as_bytes());
    out.extend(data);
    out
}

#[test]
fn npy_header_edge_cases() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("h.npy");
    let data = [0u8; 24];
    std::fs::write(
        &p,
        raw_npy(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
            &data,
        ),
    )
    .unwrap();
    let e = read_tensor(&spec(&p), None).unwrap_err();
    assert!(is_format(&e) && e.to_string().contains("Fortran"), "{e}");

    // Fortran order is the same layout as C order for 1-d arrays.
    std::fs::write(
        &p,
        raw_npy(
            "{'descr': '<f4', 'fortran_order': True, 'shape': (6,), }",
            &data,
        ),
    )
    .unwrap();
    assert_eq!(read_tensor(&spec(&p), None).unwrap().shape(), &[6]);

    for dict in [
        "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 4294967296, 4294967296, 16), }",
        "{'descr': '<c8', 'fortran_order': False, 'shape': (3,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (7,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
        "{'descr': '<f4', 'fortran_order': False}",
        "not a dict",
    ] {
        std::fs::write(&p, raw_npy(dict, &data)).unwrap();
        let e = read_tensor(&spec(&p), None).unwrap_err();
        assert!(is_format(&e), "{dict}: {e}");
    }
}

#[test]
fn dtype_mismatch_names_both() {
    let dir = tempfile::tempdir().unwrap();
    for ext in ["npy", "safetensors"] {
        let p = dir.path().join(format!("f.{ext}"));
        write_tensor(&p, &sample(DType::F32, &[2], 0)).unwrap();
        let e = read_tensor(&spec(&p), Some(DType::BF16)).unwrap_err();
        let s = e.to_string();
        assert!(
            is_invalid(&e) && s.contains("bf16") && s.contains("f32"),
            "{s}"
        );
        let e = read_tensor(&spec(&p), Some(DType::I32)).unwrap_err();
        assert!(is_invalid(&e), "{e}");
    }
}

fn leftovers(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

#[test]
fn atomic_write_is_all_or_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("out.bin");

    let e = atomic_write(&p, |w| {
        w.write_all(b"partial").unwrap();
        Err(Error::invalid("x", "y", "z"))
    })
    .unwrap_err();
    assert!(is_invalid(&e));
    assert!(leftovers(dir.path()).is_empty(), "no file, no temp file");

    atomic_write(&p, |w| w.write_all(b"first").map_err(|e| Error::io("x", e))).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"first");
    let _ = atomic_write(&p, |w| {
        w.write_all(b"second, but failing").unwrap();
        Err(Error::Internal("boom".into()))
    });
    assert_eq!(
        std::fs::read(&p).unwrap(),
        b"first",
        "destination untouched"
    );
    assert_eq!(leftovers(dir.path()), vec![p.clone()]);

    atomic_write(&p, |w| {
        w.write_all(b"second").map_err(|e| Error::io("x", e))
    })
    .unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"second");
    assert_eq!(leftovers(dir.path()), vec![p.clone()]);

    // A destination in a missing directory is an I/O error, not a panic.
    let e = atomic_write(&dir.path().join("no/such/dir/f"), |_| Ok(())).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
}

#[test]
fn atomic_create_never_replaces() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("decision.json");
    assert!(atomic_create_bytes(&p, b"first").unwrap(), "created");
    assert!(
        !atomic_create_bytes(&p, b"second").unwrap(),
        "already there"
    );
    assert_eq!(
        std::fs::read(&p).unwrap(),
        b"first",
        "the first writer wins"
    );
    assert_eq!(
        leftovers(dir.path()),
        vec![p.clone()],
        "no temporary file left"
    );
    let e = atomic_create_bytes(&dir.path().join("no/such/f"), b"x").unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");

    // Racing creators: exactly one wins and every file read back is a whole one.
    let q = dir.path().join("raced.json");
    let wins: usize = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8u8)
            .map(|i| {
                let q = &q;
                s.spawn(move || atomic_create_bytes(q, &[i; 4096]).unwrap() as usize)
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(wins, 1);
    let got = std::fs::read(&q).unwrap();
    assert!(got.len() == 4096 && got.iter().all(|&b| b == got[0]));
}

#[test]
fn streaming_integer_npy() {
    use tessera_io::open_npy_ints;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("i.npy");
    let vals: Vec<i64> = vec![0, 1, -1, 127, -128, 5];
    for dt in [DType::I8, DType::I32, DType::I64] {
        let data = match dt {
            DType::I8 => TensorData::I8(vals.iter().map(|&v| v as i8).collect()),
            DType::I32 => TensorData::I32(vals.iter().map(|&v| v as i32).collect()),
            _ => TensorData::I64(vals.clone()),
        };
        write_tensor(&p, &Tensor::new(vec![6], data).unwrap()).unwrap();
        let r = open_npy_ints(&p).unwrap();
        assert_eq!(r.len(), 6);
        assert_eq!(r.collect::<Result<Vec<_>, _>>().unwrap(), vals, "{dt}");
    }
    npyz::to_file_1d(&p, [1u16, 65535, 7]).unwrap();
    let got: Vec<i64> = open_npy_ints(&p).unwrap().map(|v| v.unwrap()).collect();
    assert_eq!(got, vec![1, 65535, 7]);
    npyz::to_file_1d(&p, [u64::MAX]).unwrap();
    assert!(open_npy_ints(&p).unwrap().next().unwrap().is_err());

    // Big-endian int32.
    let data: Vec<u8> = [1i32, -2, 300]
        .iter()
        .flat_map(|v| v.to_be_bytes())
        .collect();
    std::fs::write(
        &p,
        raw_npy(
            "{'descr': '>i4', 'fortran_order': False, 'shape': (3,), }",
            &data,
        ),
    )
    .unwrap();
    let got: Vec<i64> = open_npy_ints(&p).unwrap().map(|v| v.unwrap()).collect();
    assert_eq!(got, vec![1, -2, 300]);

    // Truncated data, 2-d, float, missing: errors up front.
    std::fs::write(
        &p,
        raw_npy(
            "{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }",
            &data,
        ),
    )
    .unwrap();
    assert!(is_format(&open_npy_ints(&p).unwrap_err()));
    write_tensor(&p, &sample(DType::I32, &[2, 2], 0)).unwrap();
    assert!(is_invalid(&open_npy_ints(&p).unwrap_err()));
    write_tensor(&p, &sample(DType::F32, &[3], 0)).unwrap();
    assert!(is_invalid(&open_npy_ints(&p).unwrap_err()));
    std::fs::write(&p, b"\x93NUMPY\x01\x00\xff\xff").unwrap();
    assert!(is_format(&open_npy_ints(&p).unwrap_err()));
    let e = open_npy_ints(&dir.path().join("none.npy")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }));
}

#[test]
fn view_writer_checks_element_counts() {
    use tessera_core::tensor::{TensorView, ViewData};
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("v.safetensors");
    let shape = [2usize, 2];
    let data = [1i32, 2, 3];
    let view = TensorView {
        shape: &shape,
        data: ViewData::I32(&data),
    };
    let e = tessera_io::write_safetensors_views(&p, &[("x", view)]).unwrap_err();
    assert!(is_invalid(&e), "{e}");
    assert!(!p.exists());
}

#[test]
fn raw_npy_arrays_round_trip_and_match_tensor_files() {
    use tessera_io::{NpyArray, NpyDType};
    let dir = tempfile::tempdir().unwrap();
    let vals = [0i64, 1, -1, 100, -7, 3];
    for dt in [
        NpyDType::Bool,
        NpyDType::U8,
        NpyDType::I8,
        NpyDType::U16,
        NpyDType::I16,
        NpyDType::I32,
        NpyDType::I64,
        NpyDType::F16,
        NpyDType::F32,
        NpyDType::F64,
    ] {
        let a = NpyArray::from_ints(dt, vec![2, 3], vals.iter().copied());
        assert_eq!(a.bytes.len(), 6 * dt.size(), "{dt:?}");
        let bytes = a.to_npy();
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!(
            (10 + header_len) % 64,
            0,
            "{dt:?}: data aligned to 64 bytes"
        );
        let back = NpyArray::from_npy(&bytes, Path::new("x.npy")).unwrap();
        assert_eq!(back, a, "{dt:?}");
        assert_eq!(back.to_i64().is_some(), dt.is_integer(), "{dt:?}");
        // Every proper prefix is a format error.
        for cut in [0, 9, 10 + header_len - 1, bytes.len() - 1] {
            let e = NpyArray::from_npy(&bytes[..cut], Path::new("x.npy")).unwrap_err();
            assert!(is_format(&e), "{dt:?} cut {cut}: {e}");
        }
    }
    // A tensor written as .npy is byte for byte the raw encoding of the same values.
    let t = Tensor::new(vec![2, 3], TensorData::I32(vec![0, 1, -1, 100, -7, 3])).unwrap();
    let p = dir.path().join("t.npy");
    write_tensor(&p, &t).unwrap();
    let raw = NpyArray::from_ints(NpyDType::I32, vec![2, 3], vals.iter().copied());
    assert_eq!(std::fs::read(&p).unwrap(), raw.to_npy());
    assert_eq!(NpyArray::read(&p).unwrap(), raw);
    // Big-endian data is not a raw array (tensors and the integer stream read it).
    let be = raw_npy(
        "{'descr': '>i4', 'fortran_order': False, 'shape': (1,), }",
        &[0, 0, 0, 1],
    );
    assert!(is_format(
        &NpyArray::from_npy(&be, Path::new("b.npy")).unwrap_err()
    ));
}

/// Found by fuzzing: npyz's header parser backtracks exponentially on nested brackets (18 `{`
/// took 23 s); such headers are refused before it runs.
#[test]
fn deeply_nested_npy_header_is_refused_quickly() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nested.npy");
    let mut h = format!(
        "{{'descr': {}'<f4', 'fortran_order': False, 'shape': (2,), }}",
        "{".repeat(40)
    );
    while (10 + h.len() + 1) % 64 != 0 {
        h.push(' ');
    }
    h.push('\n');
    let mut b = b"\x93NUMPY\x01\x00".to_vec();
    b.extend_from_slice(&(h.len() as u16).to_le_bytes());
    b.extend_from_slice(h.as_bytes());
    b.extend_from_slice(&[0u8; 8]);
    std::fs::write(&p, &b).unwrap();
    let start = std::time::Instant::now();
    let e = read_tensor(&spec(&p), None).unwrap_err();
    assert!(is_format(&e) && e.to_string().contains("nested"), "{e}");
    assert!(is_format(
        &tessera_io::NpyArray::from_npy(&b, &p).unwrap_err()
    ));
    assert!(start.elapsed().as_secs() < 2);
}
