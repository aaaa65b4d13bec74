//! Matrix products through cuBLASLt. The descriptors of each product shape and the algorithm its
//! heuristic picks are made once and kept, so a product costs one `cublasLtMatmul` call (the
//! heuristic alone takes longer than a small product runs).

use crate::error::{CudaError, Result};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// `cublasOperation_t` values for the TRANSA / TRANSB attributes.
const OP_N: i32 = 0;
const OP_T: i32 = 1;

/// One product shape: `D[m, n] = op(A)[m, k] · B[k, n] (+ C)`, column-major, A transposed (the
/// `[m, k]` row-major weight), B as is (`[n, k]` row-major activations); bf16 operands, f32
/// accumulation, D bf16 or f32.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub struct Shape {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub out_f32: bool,
    /// Elements between the starts of D's columns (the output's rows): `m`, or more when the
    /// product writes a band of a wider output.
    pub ld_out: u64,
}

impl Shape {
    /// `n` rows of `k` activations by a `[m, k]` weight, out in f32 or bf16.
    pub fn new(n: usize, k: usize, m: usize, out_f32: bool) -> Self {
        Shape {
            m: m as u64,
            n: n as u64,
            k: k as u64,
            out_f32,
            ld_out: m as u64,
        }
    }

    /// This shape writing into an output whose rows are `ld` elements apart (`ld >= m`).
    pub fn with_ld_out(self, ld: usize) -> Self {
        Shape {
            ld_out: ld as u64,
            ..self
        }
    }
}

/// Algorithms asked of cuBLASLt's heuristic per shape; the first is the one used.
const CANDIDATES: usize = 16;

/// A shape's descriptors and the algorithms the heuristic offers for it, best first.
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algos: Vec<sys::cublasLtMatmulAlgo_t>,
}

// SAFETY: the descriptors are plain host objects that cuBLASLt only reads during a call; they
// are used under the cache's mutex and destroyed once, in Drop.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once. Errors on teardown
        // have nowhere to go.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.d);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl Plan {
    fn new(handle: sys::cublasLtHandle_t, s: Shape, workspace_bytes: usize) -> Result<Plan> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let out = if s.out_f32 {
            sys::cudaDataType_t::CUDA_R_32F
        } else {
            bf16
        };
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(blas)?;
        // Dropped on an error, freeing what was made so far.
        let mut p = Plan {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algos: Vec::new(),
        };
        // A is stored [k, m] (column-major, ld k) and used transposed; B is [k, n] (ld k); D is
        // [m, n] (ld ld_out, m unless a band of a wider output).
        p.a = lt::create_matrix_layout(bf16, s.k, s.m, s.k as i64).map_err(blas)?;
        p.b = lt::create_matrix_layout(bf16, s.k, s.n, s.k as i64).map_err(blas)?;
        p.d = lt::create_matrix_layout(out, s.m, s.n, s.ld_out as i64).map_err(blas)?;
        let set_op = |attr, op: i32| {
            // SAFETY: the attribute is an i32 cublasOperation_t, passed by pointer and size.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    (&op) as *const i32 as *const c_void,
                    std::mem::size_of::<i32>(),
                )
            }
        };
        set_op(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            OP_T,
        )
        .map_err(blas)?;
        set_op(
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
            OP_N,
        )
        .map_err(blas)?;
        let pref = lt::create_matmul_pref().map_err(blas)?;
        let bytes = workspace_bytes as u64;
        let mut results: [std::mem::MaybeUninit<sys::cublasLtMatmulHeuristicResult_t>; CANDIDATES] =
            [std::mem::MaybeUninit::uninit(); CANDIDATES];
        let mut count = 0i32;
        // SAFETY: the preference is an u64 byte count, passed by pointer and size; the layouts
        // and descriptor are valid (made above); the heuristic writes at most CANDIDATES results
        // and says how many; the preference is destroyed right after.
        let status = unsafe {
            let r = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&bytes) as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .and_then(|()| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    handle,
                    desc,
                    p.a,
                    p.b,
                    p.d,
                    p.d,
                    pref,
                    CANDIDATES as i32,
                    results.as_mut_ptr().cast(),
                    &mut count,
                )
                .result()
            });
            let _ = lt::destroy_matmul_pref(pref);
            r
        };
        status.map_err(blas)?;
        for r in results
            .iter()
            .take(count.clamp(0, CANDIDATES as i32) as usize)
        {
            // SAFETY: the heuristic filled the first `count` results.
            let r = unsafe { r.assume_init() };
            if r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
                && r.workspaceSize <= workspace_bytes
            {
                p.algos.push(r.algo);
            }
        }
        if p.algos.is_empty() {
            return Err(blas(lt::CublasError(
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED,
            )));
        }
        Ok(p)
    }
}

fn blas(e: lt::CublasError) -> CudaError {
    CudaError::BlasLt(format!("{e:?}"))
}

/// The device's cuBLASLt handle and its plans by shape.
pub struct LtMatmul {
    handle: sys::cublasLtHandle_t,
    plans: Mutex<HashMap<Shape, Plan>>,
}

// SAFETY: the handle is used only through `&self` methods that issue work on the caller's stream;
// cuBLASLt handles may be shared between threads (cuBLASLt keeps no per-call state in them).
unsafe impl Send for LtMatmul {}
unsafe impl Sync for LtMatmul {}

impl LtMatmul {
    pub fn new() -> Result<Self> {
        Ok(LtMatmul {
            handle: lt::create_handle().map_err(blas)?,
            plans: Mutex::new(HashMap::new()),
        })
    }

    /// How many algorithms the heuristic offers for `shape` (at most 16), for benchmarks that
    /// compare them ([`LtMatmul::matmul_with`]).
    pub fn candidates(&self, shape: Shape, workspace_bytes: usize) -> Result<usize> {
        let mut plans = self.plans.lock().unwrap();
        Ok(Self::plan(&mut plans, self.handle, shape, workspace_bytes)?
            .algos
            .len())
    }

    fn plan(
        plans: &mut HashMap<Shape, Plan>,
        handle: sys::cublasLtHandle_t,
        shape: Shape,
        workspace_bytes: usize,
    ) -> Result<&Plan> {
        Ok(match plans.entry(shape) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(Plan::new(handle, shape, workspace_bytes)?)
            }
        })
    }

    /// `d = a_op · b + beta · d` for `shape` (see [`Shape`]), alpha 1, on `stream`, with the
    /// heuristic's `candidate`-th algorithm (0: its first choice, what the products use; others
    /// for benchmarks comparing them).
    ///
    /// # Safety
    /// `a`, `b` and `d` must point to device buffers holding at least `m·k`, `k·n` and `m·n`
    /// elements of the shape's types, and `workspace` to `workspace_bytes` bytes, all valid until
    /// the stream has run the product; nothing else may use the workspace meanwhile.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_with(
        &self,
        shape: Shape,
        candidate: usize,
        a: u64,
        b: u64,
        d: u64,
        beta: f32,
        workspace: u64,
        workspace_bytes: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let mut plans = self.plans.lock().unwrap();
        let p = Self::plan(&mut plans, self.handle, shape, workspace_bytes)?;
        let algo = p.algos.get(candidate).ok_or_else(|| {
            CudaError::BlasLt(format!(
                "{shape:?}: candidate {candidate} of {} algorithms",
                p.algos.len()
            ))
        })?;
        let alpha = 1.0f32;
        lt::matmul(
            self.handle,
            p.desc,
            (&alpha) as *const f32 as *const c_void,
            (&beta) as *const f32 as *const c_void,
            a as *const c_void,
            p.a,
            b as *const c_void,
            p.b,
            d as *const c_void,
            p.d,
            d as *mut c_void,
            p.d,
            algo,
            workspace as *mut c_void,
            workspace_bytes,
            stream as sys::cudaStream_t,
        )
        .map_err(blas)
    }
}

impl Drop for LtMatmul {
    fn drop(&mut self) {
        self.plans.lock().unwrap().clear();
        // SAFETY: the handle was created in `new` and is destroyed once, after its plans.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
