//! `DenseMask::from_words` (rows already packed) is the same mask as `DenseMask::new` of the
//! unpacked values: same digest, same bits; bits past `Lkv` are refused.

use tessera_mask::DenseMask;

#[test]
fn packed_rows_equal_unpacked_values() {
    for &(shape, seed) in &[
        (&[3usize, 5][..], 1u64),
        (&[2, 7, 64][..], 2),
        (&[2, 3, 4, 130][..], 3),
        (&[1, 200][..], 4),
    ] {
        let kv = *shape.last().expect("rank >= 2");
        let n: usize = shape.iter().product();
        let vals: Vec<bool> = (0..n as u64)
            .map(|k| (k.wrapping_mul(seed * 2 + 0x9e37_79b9) >> 5) % 3 == 0)
            .collect();
        let w = kv.div_ceil(64);
        let mut words = vec![0u64; n / kv * w];
        for (k, &v) in vals.iter().enumerate() {
            if v {
                let (r, j) = (k / kv, k % kv);
                words[r * w + j / 64] |= 1 << (j % 64);
            }
        }
        let a = DenseMask::new(shape, &vals, "a").expect("new");
        let b = DenseMask::from_words(shape, words.clone(), "a").expect("from_words");
        assert_eq!(a, b, "{shape:?}");
        assert_eq!(a.digest(), b.digest());
        if kv % 64 != 0 {
            words[w - 1] |= 1 << 63;
            assert!(
                DenseMask::from_words(shape, words, "a").is_err(),
                "{shape:?}"
            );
        }
    }
    assert!(DenseMask::from_words(&[2, 3], vec![0; 1], "a").is_err());
    assert!(DenseMask::from_words(&[0, 3], vec![], "a").is_err());
    assert!(DenseMask::from_words(&[3], vec![0; 1], "a").is_err());
}
