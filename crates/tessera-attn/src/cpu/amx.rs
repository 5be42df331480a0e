//! AMX-BF16 tile products: whether this process may use AMX ([`status`]: CPUID, the OS's
//! XSAVE state and, on Linux, the `arch_prctl(ARCH_REQ_XCOMP_PERM)` permission, requested once),
//! and [`gemm`], `C (+)= A·B` over bf16 pairs with f32 accumulation on the tile unit.
//!
//! Layout (the `vdpbf16ps` kernels' own): `A` is `[m × kp]` 32-bit words, row-major, each word a
//! pair of bf16 along the product's inner dimension (low half first); `B` is `[kp × n]` words,
//! row `p` holding, for every output column, the pair of inner elements `2p, 2p + 1` (the VNNI
//! layout `tdpbf16ps` reads); `C` is `[m × n]` f32, row-major. `m`, `n` and `kp` are multiples
//! of 16: one tile is 16 rows of 64 bytes (16 words or 16 f32), and a product step reads 16
//! rows of `A` by 16 pairs and 16 pairs of `B` by 16 columns.
//!
//! Contract: [`gemm`] checks every extent against its slices before any tile instruction runs,
//! so no tile load or store leaves them; it configures the tiles itself and releases them before
//! it returns. The products go through a [`Unit`]: [`Hw`] (the instructions, via `asm!`) where
//! [`status`] is `Ok`, or [`Model`] (the instructions' documented semantics in Rust, on a
//! per-thread register file) for tests on CPUs without AMX. Both take the same instruction
//! sequence from the same driver, so the model checks the addressing and the register use of
//! the hardware path, not only the arithmetic.
//!
//! Arithmetic: `tdpbf16ps` adds, per output, `a_lo·b_lo` then `a_hi·b_hi` to the accumulator
//! (products of bf16 values are exact in f32, so each step rounds once, to nearest even), with
//! bf16 denormal inputs read as zero and denormal results flushed to zero.

/// Words per tile row (64 bytes).
pub(crate) const TW: usize = 16;

/// The environment variable that, set to `1`, runs the AMX kernels on the software model of
/// the tile unit where the CPU has no AMX: for testing them anywhere; orders of magnitude slower
/// than any other path.
pub const MODEL_ENV: &str = "TESSERA_AMX_MODEL";

/// Which tile unit the AMX kernels run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The CPU's ([`Hw`]).
    Hw,
    /// The software model ([`Model`]).
    Model,
}

/// The unit AMX kernels use in this process: the hardware where [`status`] is `Ok`, else the
/// model when [`MODEL_ENV`] is `1`, else none.
pub(crate) fn unit() -> Option<Kind> {
    static UNIT: std::sync::OnceLock<Option<Kind>> = std::sync::OnceLock::new();
    *UNIT.get_or_init(|| match status() {
        Ok(()) => Some(Kind::Hw),
        Err(_) => (std::env::var(MODEL_ENV).as_deref() == Ok("1")).then_some(Kind::Model),
    })
}

/// Whether this process may run AMX-BF16 tile instructions, or why not.
pub(crate) fn status() -> Result<(), &'static str> {
    static STATUS: std::sync::OnceLock<Result<(), &'static str>> = std::sync::OnceLock::new();
    *STATUS.get_or_init(probe)
}

#[cfg(target_arch = "x86_64")]
fn probe() -> Result<(), &'static str> {
    hardware()?;
    request_permission()?;
    self_check()
}

/// Whether the CPU reports AMX-BF16 and AMX-TILE and the OS enabled the tile state, and
/// `TESSERA_HIDE_ISA` does not hide it, or why not; asks no permission. The one check is
/// [`tessera_core::cpu_features::amx_hardware`].
#[cfg(target_arch = "x86_64")]
pub(crate) fn hardware() -> Result<(), &'static str> {
    tessera_core::cpu_features::amx_hardware()
}

/// A product on the tile unit against the model's, before any kernel uses AMX: a layout or
/// configuration the hardware reads differently from the model shows as a wrong product here,
/// and AMX is then not used (the kernels fall back to `vdpbf16ps`).
#[cfg(target_arch = "x86_64")]
fn self_check() -> Result<(), &'static str> {
    // SAFETY: `probe` calls this only with AMX-BF16, the tile state and its permission.
    if unsafe { agrees_with_model::<Hw>() } {
        Ok(())
    } else {
        Err("the AMX self-check disagreed with the model of tdpbf16ps")
    }
}

/// Whether unit `U`'s product of a 32×48×32 case (every accumulator tile, two k steps,
/// accumulation into C) equals the model's up to rounding.
///
/// # Safety
/// As [`gemm`] with `U`.
unsafe fn agrees_with_model<U: Unit>() -> bool {
    let (m, n, kp) = (32, 48, 32);
    let word = |seed: u32, i: usize| {
        // Normal bf16 values in ±[0.5, 2): exponent 126 or 127, a varying mantissa and sign.
        let h = |x: u32| ((x & 0x8000) | ((0x7E + (x >> 7 & 1)) << 7) | (x & 0x7F)) & 0xFFFF;
        let x = (i as u32).wrapping_mul(0x9E37_79B9) ^ seed.wrapping_mul(0x85EB_CA6B);
        h(x) | h(x >> 13) << 16
    };
    let a: Vec<u32> = (0..m * kp).map(|i| word(1, i)).collect();
    let b: Vec<u32> = (0..kp * n).map(|i| word(2, i)).collect();
    let c0_at = |i: usize| (i % 5) as f32 - 2.0;
    let c0_abs = |i: usize| c0_at(i).abs() + 1.0;
    let c0: Vec<f32> = (0..m * n).map(c0_at).collect();
    let (mut hw, mut model) = (c0.clone(), c0);
    // SAFETY: the caller's contract for `U`; the model has none.
    unsafe {
        gemm::<U>((m, n, kp), (&a, kp), (&b, n), (&mut hw, n), true);
        gemm::<Model>((m, n, kp), (&a, kp), (&b, n), (&mut model, n), true);
    }
    // Within 1e-4 of each output's sum of magnitudes: another summation order or rounding of
    // the same products stays far inside it, a product of other elements (a layout the hardware
    // reads differently) far outside.
    let f = |w: u32, hi: bool| bf16_daz(if hi { w >> 16 } else { w }).abs();
    (0..m * n).all(|i| {
        let (r, x) = (i / n, i % n);
        let mag = (0..kp).fold(c0_abs(i), |acc, p| {
            let (wa, wb) = (a[r * kp + p], b[p * n + x]);
            acc + f(wa, false) * f(wb, false) + f(wa, true) * f(wb, true)
        });
        (hw[i] - model[i]).abs() <= 1e-4 * mag
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn probe() -> Result<(), &'static str> {
    Err("AMX exists only on x86-64")
}

/// Linux grants the tile data state to a process only on request (`arch_prctl`
/// `ARCH_REQ_XCOMP_PERM`, `XFEATURE_XTILEDATA`); without it the first tile instruction faults.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_permission() -> Result<(), &'static str> {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: a plain system call with integer arguments; it reads and writes no user memory.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    if ret == 0 {
        Ok(())
    } else {
        Err("the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_permission() -> Result<(), &'static str> {
    Err("AMX is used on Linux only (the tile-state permission request is Linux's)")
}

/// The tile configuration every product uses: palette 1, tiles 0–7 all 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileCfg {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CFG: TileCfg = TileCfg {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tile instructions the driver uses. Tiles are numbered 0–7; every pointer addresses 16
/// rows of 64 bytes, `stride` bytes apart.
pub(crate) trait Unit {
    /// `ldtilecfg` of [`CFG`].
    unsafe fn configure();
    /// `tilerelease`.
    unsafe fn release();
    /// `tilezero tmm{t}`.
    unsafe fn zero(t: u8);
    /// `tileloadd tmm{t}, [p + stride]`.
    unsafe fn load(t: u8, p: *const u8, stride: usize);
    /// `tilestored [p + stride], tmm{t}`.
    unsafe fn store(t: u8, p: *mut u8, stride: usize);
    /// `tdpbf16ps tmm{c}, tmm{a}, tmm{b}`.
    unsafe fn dot(c: u8, a: u8, b: u8);
}

/// The AMX instructions themselves (only where [`status`] is `Ok`).
pub(crate) struct Hw;

#[cfg(target_arch = "x86_64")]
/// One `asm!` per tile register `$t` (0–7; `asm!` cannot take a register number as an operand):
/// the template is `$pre`, the number, `$post`.
macro_rules! by_tile {
    ($t:expr, $pre:literal, $post:literal, $($ops:tt)*) => {
        match $t {
            0 => std::arch::asm!(concat!($pre, "0", $post), $($ops)*),
            1 => std::arch::asm!(concat!($pre, "1", $post), $($ops)*),
            2 => std::arch::asm!(concat!($pre, "2", $post), $($ops)*),
            3 => std::arch::asm!(concat!($pre, "3", $post), $($ops)*),
            4 => std::arch::asm!(concat!($pre, "4", $post), $($ops)*),
            5 => std::arch::asm!(concat!($pre, "5", $post), $($ops)*),
            6 => std::arch::asm!(concat!($pre, "6", $post), $($ops)*),
            _ => std::arch::asm!(concat!($pre, "7", $post), $($ops)*),
        }
    };
}

#[cfg(target_arch = "x86_64")]
impl Unit for Hw {
    #[inline(always)]
    unsafe fn configure() {
        // SAFETY: `CFG` is a valid palette-1 configuration; the caller checked `status`.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &CFG as *const TileCfg, options(nostack, readonly))
        }
    }
    #[inline(always)]
    unsafe fn release() {
        // SAFETY: as above.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) }
    }
    #[inline(always)]
    unsafe fn zero(t: u8) {
        // SAFETY: as above; writes only the tile register.
        unsafe { by_tile!(t, "tilezero tmm", "", options(nostack, nomem)) }
    }
    #[inline(always)]
    unsafe fn load(t: u8, p: *const u8, stride: usize) {
        // SAFETY: the caller guarantees 16 readable rows of 64 bytes, `stride` apart.
        unsafe {
            by_tile!(t, "tileloadd tmm", ", [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride,
                options(nostack, readonly))
        }
    }
    #[inline(always)]
    unsafe fn store(t: u8, p: *mut u8, stride: usize) {
        // SAFETY: the caller guarantees 16 writable rows of 64 bytes, `stride` apart.
        unsafe {
            by_tile!(t, "tilestored [{p} + {s}*1], tmm", "", p = in(reg) p, s = in(reg) stride,
                options(nostack))
        }
    }
    #[inline(always)]
    unsafe fn dot(c: u8, a: u8, b: u8) {
        // SAFETY: register-only; the driver pairs accumulators 0–3 with A tiles 4–5 and B
        // tiles 6–7 only.
        unsafe {
            match (c, a, b) {
                (0, 4, 6) => std::arch::asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
                (1, 4, 7) => std::arch::asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem)),
                (2, 5, 6) => std::arch::asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem)),
                _ => std::arch::asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem)),
            }
        }
    }
}

/// The tile instructions' semantics on a per-thread register file (tests on CPUs without AMX).
pub(crate) struct Model;

#[derive(Clone, Copy)]
struct ModelState {
    configured: bool,
    tiles: [[u32; 256]; 8],
}

thread_local! {
    // Boxed: the thread-local slot stays one pointer (an 8 KiB slot of static TLS fails to load
    // in a `dlopen`ed extension module).
    static MODEL: std::cell::RefCell<Option<Box<ModelState>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` on this thread's model state (made on first use).
fn with_model<R>(f: impl FnOnce(&mut ModelState) -> R) -> R {
    MODEL.with(|m| {
        let mut m = m.borrow_mut();
        let state = m.get_or_insert_with(|| {
            Box::new(ModelState {
                configured: false,
                tiles: [[0; 256]; 8],
            })
        });
        f(state)
    })
}

/// bf16 bits `h` as f32, denormals read as zero (as `tdpbf16ps` reads them).
fn bf16_daz(h: u32) -> f32 {
    let h = h & 0xFFFF;
    if h & 0x7F80 == 0 {
        f32::from_bits((h & 0x8000) << 16)
    } else {
        f32::from_bits(h << 16)
    }
}

/// Denormal results flushed to zero (sign kept).
fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

impl Unit for Model {
    unsafe fn configure() {
        with_model(|m| m.configured = true);
    }
    unsafe fn release() {
        with_model(|m| {
            m.configured = false;
            m.tiles = [[0; 256]; 8];
        });
    }
    unsafe fn zero(t: u8) {
        with_model(|m| {
            assert!(m.configured, "tile op before ldtilecfg");
            m.tiles[t as usize] = [0; 256];
        });
    }
    unsafe fn load(t: u8, p: *const u8, stride: usize) {
        with_model(|m| {
            assert!(m.configured, "tile op before ldtilecfg");
            for r in 0..16 {
                for w in 0..16 {
                    // SAFETY: the caller guarantees 16 readable rows of 64 bytes.
                    m.tiles[t as usize][r * 16 + w] =
                        unsafe { p.add(r * stride + 4 * w).cast::<u32>().read_unaligned() };
                }
            }
        });
    }
    unsafe fn store(t: u8, p: *mut u8, stride: usize) {
        with_model(|m| {
            assert!(m.configured, "tile op before ldtilecfg");
            for r in 0..16 {
                for w in 0..16 {
                    // SAFETY: the caller guarantees 16 writable rows of 64 bytes.
                    unsafe {
                        p.add(r * stride + 4 * w)
                            .cast::<u32>()
                            .write_unaligned(m.tiles[t as usize][r * 16 + w])
                    };
                }
            }
        });
    }
    unsafe fn dot(c: u8, a: u8, b: u8) {
        with_model(|m| {
            assert!(m.configured, "tile op before ldtilecfg");
            let (ta, tb) = (m.tiles[a as usize], m.tiles[b as usize]);
            let tc = &mut m.tiles[c as usize];
            for r in 0..16 {
                for n in 0..16 {
                    let mut acc = f32::from_bits(tc[r * 16 + n]);
                    for k in 0..16 {
                        let (x, y) = (ta[r * 16 + k], tb[k * 16 + n]);
                        acc = ftz(acc + bf16_daz(x) * bf16_daz(y));
                        acc = ftz(acc + bf16_daz(x >> 16) * bf16_daz(y >> 16));
                    }
                    tc[r * 16 + n] = acc.to_bits();
                }
            }
        });
    }
}

/// `C = A·B` (`acc = false`) or `C += A·B` over `m × n` outputs and `kp` pairs, on unit `U`
/// (see the module doc for the layouts). Leading dimensions are in elements (words, f32).
///
/// # Panics
/// When `m`, `n` or `kp` is not a multiple of 16, or a slice is shorter than its extents.
///
/// # Safety
/// With [`Hw`], [`status`] must be `Ok`.
pub(crate) unsafe fn gemm<U: Unit>(
    (m, n, kp): (usize, usize, usize),
    (a, lda): (&[u32], usize),
    (b, ldb): (&[u32], usize),
    (c, ldc): (&mut [f32], usize),
    acc: bool,
) {
    assert!(
        m.is_multiple_of(TW) && n.is_multiple_of(TW) && kp.is_multiple_of(TW),
        "amx gemm: m={m} n={n} kp={kp} not multiples of 16"
    );
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        lda >= kp && ldb >= n && ldc >= n,
        "amx gemm: leading dimensions"
    );
    assert!(
        kp == 0 || a.len() >= (m - 1) * lda + kp,
        "amx gemm: A too short"
    );
    assert!(
        kp == 0 || b.len() >= (kp - 1) * ldb + n,
        "amx gemm: B too short"
    );
    assert!(c.len() >= (m - 1) * ldc + n, "amx gemm: C too short");
    let (ap, bp, cp) = (
        a.as_ptr().cast::<u8>(),
        b.as_ptr().cast::<u8>(),
        c.as_mut_ptr(),
    );
    let (sa, sb, sc) = (4 * lda, 4 * ldb, 4 * ldc);
    // SAFETY: every tile below is 16 rows × 16 elements at rows `i.. i + 16 <= m` (A, C),
    // `k0..k0 + 16 <= kp` (B) and columns `k0..k0 + 16 <= kp` (A), `j..j + 16 <= n` (B, C): inside
    // the slices by the asserts above. `U = Hw` only with `status` Ok (caller).
    unsafe {
        U::configure();
        for i in (0..m).step_by(2 * TW) {
            let two_rows = i + TW < m;
            for j in (0..n).step_by(2 * TW) {
                let two_cols = j + TW < n;
                // Accumulators: 0 (i, j), 1 (i, j + 16), 2 (i + 16, j), 3 (i + 16, j + 16).
                let tiles = [(0u8, 0, 0), (1, 0, TW), (2, TW, 0), (3, TW, TW)];
                let live = |&(_, di, dj): &(u8, usize, usize)| {
                    (di == 0 || two_rows) && (dj == 0 || two_cols)
                };
                for &(t, di, dj) in tiles.iter().filter(|x| live(x)) {
                    if acc {
                        U::load(t, cp.add((i + di) * ldc + j + dj).cast(), sc);
                    } else {
                        U::zero(t);
                    }
                }
                for k0 in (0..kp).step_by(TW) {
                    U::load(4, ap.add(4 * (i * lda + k0)), sa);
                    U::load(6, bp.add(4 * (k0 * ldb + j)), sb);
                    U::dot(0, 4, 6);
                    if two_cols {
                        U::load(7, bp.add(4 * (k0 * ldb + j + TW)), sb);
                        U::dot(1, 4, 7);
                    }
                    if two_rows {
                        U::load(5, ap.add(4 * ((i + TW) * lda + k0)), sa);
                        U::dot(2, 5, 6);
                        if two_cols {
                            U::dot(3, 5, 7);
                        }
                    }
                }
                for &(t, di, dj) in tiles.iter().filter(|x| live(x)) {
                    U::store(t, cp.add((i + di) * ldc + j + dj).cast(), sc);
                }
            }
        }
        U::release();
    }
}

/// [`gemm`] on the unit `kind`.
///
/// # Safety
/// `kind` must come from [`unit`] (so `Hw` only where [`status`] is `Ok`).
pub(crate) unsafe fn gemm_on(
    kind: Kind,
    dims: (usize, usize, usize),
    a: (&[u32], usize),
    b: (&[u32], usize),
    c: (&mut [f32], usize),
    acc: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        match kind {
            Kind::Hw => gemm::<Hw>(dims, a, b, c, acc),
            Kind::Model => gemm::<Model>(dims, a, b, c, acc),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two bf16 bit patterns as one word (`lo` in the low half).
    fn pair(lo: u16, hi: u16) -> u32 {
        lo as u32 | (hi as u32) << 16
    }

    /// Deterministic pseudo-random bf16 bits of moderate magnitude (normal, either sign).
    fn bf16_bits(seed: u64, i: usize) -> u16 {
        let x = (seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_mul(0xD6E8_FEB8_6659_FD93);
        let v = ((x >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
        half::bf16::from_f32(v).to_bits()
    }

    /// `gemm::<U>` against products in f64 of the same bf16 values, every block shape (1 or 2
    /// tiles per side, several k steps), both accumulation modes, padded leading dimensions.
    fn check<U: Unit>() {
        for &(m, n, kp) in &[
            (16, 16, 16),
            (32, 48, 32),
            (48, 16, 48),
            (64, 64, 32),
            (16, 80, 64),
        ] {
            let (lda, ldb, ldc) = (kp + 16, n + 16, n + 3);
            let a: Vec<u32> = (0..m * lda)
                .map(|i| pair(bf16_bits(1, 2 * i), bf16_bits(1, 2 * i + 1)))
                .collect();
            let b: Vec<u32> = (0..kp * ldb)
                .map(|i| pair(bf16_bits(2, 2 * i), bf16_bits(2, 2 * i + 1)))
                .collect();
            let c0: Vec<f32> = (0..m * ldc).map(|i| (i % 7) as f32 * 0.5 - 1.0).collect();
            for acc in [false, true] {
                let mut c = c0.clone();
                // SAFETY: `Model` has no precondition; `Hw` only runs where `status` is Ok.
                unsafe { gemm::<U>((m, n, kp), (&a, lda), (&b, ldb), (&mut c, ldc), acc) };
                let f = |w: u32, hi: bool| {
                    let h = if hi { w >> 16 } else { w & 0xFFFF };
                    f32::from_bits(h << 16) as f64
                };
                for r in 0..m {
                    for x in 0..ldc {
                        let got = c[r * ldc + x];
                        if x >= n {
                            assert_eq!(got.to_bits(), c0[r * ldc + x].to_bits(), "padding written");
                            continue;
                        }
                        let mut want = if acc { c0[r * ldc + x] as f64 } else { 0.0 };
                        for p in 0..kp {
                            let (wa, wb) = (a[r * lda + p], b[p * ldb + x]);
                            want += f(wa, false) * f(wb, false) + f(wa, true) * f(wb, true);
                        }
                        let tol = 1e-5 * (1.0 + (2 * kp) as f64);
                        assert!(
                            (got as f64 - want).abs() <= tol,
                            "m={m} n={n} kp={kp} acc={acc} ({r}, {x}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn model_products_equal_f64_products() {
        check::<Model>();
    }

    #[test]
    fn hardware_products_equal_f64_products() {
        match status() {
            // SAFETY: `status` is Ok.
            Ok(()) => check::<Hw>(),
            Err(why) => println!("skipped: {why}"),
        }
    }

    /// The model with its two B tiles crossed: the register-use error a self-check must catch.
    struct CrossedB;
    impl Unit for CrossedB {
        unsafe fn configure() {
            unsafe { Model::configure() }
        }
        unsafe fn release() {
            unsafe { Model::release() }
        }
        unsafe fn zero(t: u8) {
            unsafe { Model::zero(t) }
        }
        unsafe fn load(t: u8, p: *const u8, stride: usize) {
            unsafe { Model::load(t, p, stride) }
        }
        unsafe fn store(t: u8, p: *mut u8, stride: usize) {
            unsafe { Model::store(t, p, stride) }
        }
        unsafe fn dot(c: u8, a: u8, b: u8) {
            unsafe { Model::dot(c, a, 13 - b) }
        }
    }

    #[test]
    fn the_self_check_passes_the_model_and_fails_a_wrong_unit() {
        // SAFETY: model units only.
        unsafe {
            assert!(agrees_with_model::<Model>());
            assert!(!agrees_with_model::<CrossedB>());
        }
    }

    #[test]
    fn model_reads_denormals_as_zero_and_flushes_results() {
        assert_eq!(bf16_daz(0x0001), 0.0);
        assert_eq!(bf16_daz(0x8001).to_bits(), 0x8000_0000);
        assert_eq!(bf16_daz(0x3F80), 1.0);
        assert_eq!(ftz(f32::from_bits(1)), 0.0);
        assert_eq!(ftz(1.5), 1.5);
    }

    #[test]
    #[should_panic(expected = "not multiples of 16")]
    fn unpadded_extents_are_refused() {
        let (a, b, mut c) = (
            vec![0u32; 16 * 16],
            vec![0u32; 16 * 16],
            vec![0f32; 16 * 16],
        );
        // SAFETY: panics before any tile instruction.
        unsafe { gemm::<Model>((16, 8, 16), (&a, 16), (&b, 16), (&mut c, 16), false) };
    }

    #[test]
    fn status_names_its_reason() {
        if let Err(why) = status() {
            assert!(!why.is_empty());
        }
    }
}
