//! A CUDA device with its stream, cuBLASLt handle and loaded kernel modules.

use crate::error::{CudaError, Result};
use crate::lt::LtMatmul;
use crate::ptx::{KernelModule, MODULES};
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Environment variable naming a directory of kernel modules that replace the embedded ones: a
/// module's `NAME.ptx` there is loaded, else its `NAME.cu` compiled with NVRTC (a module with
/// neither loads as it would without the variable). For kernel work on
/// a GPU machine without a Rust toolchain: edited kernels run without rebuilding the binary, and
/// nvcc's PTX and NVRTC's can be compared on the same source.
pub const KERNELS_DIR_ENV: &str = "TURBO_KERNELS_DIR";

/// Whether a CUDA driver library is loadable and reports at least one device. Never panics on a
/// machine without CUDA.
pub fn device_count() -> usize {
    // SAFETY: only probes for the shared library; touches no driver state.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| n.max(0) as usize)
}

pub fn cuda_available() -> bool {
    device_count() > 0
}

/// cuBLASLt's workspace (32 MiB, what cuBLASLt asks for on Hopper): the device's own, so that
/// products recorded into a CUDA graph use a buffer that outlives the recording.
pub(crate) const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

/// One GPU: a context, the single stream all work is issued on, a cuBLASLt handle with its
/// workspace, and kernel modules loaded on first use.
pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    side: Arc<SideStream>,
    pub(crate) blas: LtMatmul,
    pub(crate) blas_workspace: CudaSlice<u8>,
    sm_count: usize,
    /// Compute capability (major, minor).
    compute: (i32, i32),
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CudaFunction>>,
    /// Dynamic shared memory each function has been opted in to, beyond the default 48 KiB.
    smem_opt_in: Mutex<HashMap<(&'static str, &'static str), usize>>,
}

/// A second stream of the device, and the two events that order it against the main one.
pub(crate) struct SideStream {
    main: Arc<CudaStream>,
    stream: Arc<CudaStream>,
    /// Recorded on the main stream by `fork_side`, waited for by the side stream.
    forked: CudaEvent,
    /// Recorded on the side stream by `join_side`, waited for by the main stream.
    done: CudaEvent,
    /// Whether work was issued on the side stream since the last join.
    pending: AtomicBool,
}

/// See [`CudaDevice::side_guard`].
pub(crate) struct SideGuard(Arc<SideStream>);

impl Drop for SideGuard {
    fn drop(&mut self) {
        // Nothing to report to: a failed join leaves the device in an error state that the next
        // call on it reports.
        let _ = self.0.join();
    }
}

impl SideStream {
    /// [`CudaDevice::join_side`].
    pub(crate) fn join(&self) -> Result<()> {
        if self.pending.swap(false, Ordering::Relaxed) {
            self.done.record(&self.stream)?;
            self.main.wait(&self.done)?;
        }
        Ok(())
    }
}

impl CudaDevice {
    pub fn new(ordinal: usize) -> Result<Self> {
        let count = device_count();
        if ordinal >= count {
            return Err(CudaError::NoDevice(if count == 0 {
                "no CUDA driver or GPU found on this machine".into()
            } else {
                format!("device {ordinal} requested, {count} present")
            }));
        }
        let ctx = CudaContext::new(ordinal)?;
        // SAFETY: this device's work is issued on the stream made below, in order, and on the
        // side stream only between `fork_side` and `join_side`, whose events order it; cudarc's
        // per-buffer events (which order uses across streams) would add nothing.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own rather than the legacy default stream, which cannot be captured
        // into a graph.
        // The main stream at the highest priority and the side stream at the lowest: the block
        // scheduler then starts a side kernel's blocks only where the step's own kernels leave
        // room, instead of delaying them (recorded steps keep the priorities:
        // `CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`).
        let (least, greatest) = cudarc::driver::result::stream::get_priority_range()?;
        let stream = ctx.new_stream_with_priority(greatest)?;
        let side = Arc::new(SideStream {
            main: stream.clone(),
            stream: ctx.new_stream_with_priority(least)?,
            forked: ctx.new_event(None)?,
            done: ctx.new_event(None)?,
            pending: AtomicBool::new(false),
        });
        let blas = LtMatmul::new()?;
        let blas_workspace = stream.alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)?;
        let sm_count = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            .max(1) as usize;
        let compute = (
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        Ok(CudaDevice {
            ctx,
            stream,
            side,
            blas,
            blas_workspace,
            sm_count,
            compute,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            smem_opt_in: Mutex::new(HashMap::new()),
        })
    }

    /// The side stream, after it was made to wait for the work issued on [`CudaDevice::stream`]
    /// so far: for work that nothing later in the step reads (the KV eviction scores' passes over
    /// a layer's logits), so that it runs beside the step's next kernels rather than between
    /// them. Until [`CudaDevice::join_side`], the caller orders every other use of what that work
    /// touches.
    pub fn fork_side(&self) -> Result<&CudaStream> {
        self.side.forked.record(&self.stream)?;
        self.side.stream.wait(&self.side.forked)?;
        self.side.pending.store(true, Ordering::Relaxed);
        Ok(&self.side.stream)
    }

    /// Makes [`CudaDevice::stream`] wait for everything issued on the side stream (nothing when
    /// nothing was issued since the last join). A step recorded into a CUDA graph joins before
    /// its recording ends, and anything that reads what side work wrote joins first.
    pub fn join_side(&self) -> Result<()> {
        self.side.join()
    }

    /// A guard for buffers that side work may use, declared before them in their owner: it
    /// joins the side stream when dropped, so that their frees, ordered on the main stream,
    /// come after that work.
    pub(crate) fn side_guard(&self) -> SideGuard {
        SideGuard(self.side.clone())
    }

    /// Streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// Compute capability (major, minor), e.g. (9, 0) for an H100.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute
    }

    /// Whether this device can load a kernel module: modules of architecture-specific
    /// instructions (see [`KernelModule::only_on`]) load only on their architecture.
    pub fn supports_module(&self, name: &str) -> bool {
        MODULES
            .iter()
            .any(|m| m.name == name && m.only_on.is_none_or(|cc| cc == self.compute))
    }

    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|_| "CUDA device".into())
    }

    /// A kernel function, loading its module on first use (the committed PTX, else NVRTC).
    pub fn function(&self, module: &'static str, name: &'static str) -> Result<CudaFunction> {
        if let Some(f) = self.functions.lock().unwrap().get(&(module, name)) {
            return Ok(f.clone());
        }
        let m = self.module(module)?;
        let f = m.load_function(name).map_err(|e| CudaError::Module {
            module: module.into(),
            reason: format!("no kernel '{name}': {e}"),
        })?;
        self.functions
            .lock()
            .unwrap()
            .insert((module, name), f.clone());
        Ok(f)
    }

    /// [`CudaDevice::function`], opted in to `smem_bytes` of dynamic shared memory when that is
    /// above the default 48 KiB. The attribute stays with the function, so the driver is asked
    /// once per function (and size), not at every launch.
    pub fn function_with_smem(
        &self,
        module: &'static str,
        name: &'static str,
        smem_bytes: usize,
    ) -> Result<CudaFunction> {
        let f = self.function(module, name)?;
        if smem_bytes > 48 * 1024 {
            let mut opted = self.smem_opt_in.lock().unwrap();
            let have = opted.entry((module, name)).or_insert(0);
            if *have < smem_bytes {
                f.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem_bytes as i32,
                )?;
                *have = smem_bytes;
            }
        }
        Ok(f)
    }

    /// Launches `f` as a programmatic dependent of the kernel ahead of it in the stream
    /// (Hopper's dependent launch, `cuLaunchKernelEx` with programmatic stream serialization):
    /// its blocks may start as soon as that kernel lets them (`griddepcontrol.launch_dependents`)
    /// or ends, instead of after everything it wrote is visible. Recorded into CUDA graphs as a
    /// programmatic edge.
    ///
    /// # Safety
    /// `params` points at the kernel's arguments, in order and of its types, alive for the
    /// call. The kernel runs `griddepcontrol.wait` before it reads or writes anything that a
    /// kernel ahead of it may still touch.
    pub(crate) unsafe fn launch_dependent(
        &self,
        f: &CudaFunction,
        cfg: cudarc::driver::LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        self.ctx.bind_to_thread()?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: the caller's contract for the arguments; the configuration and attribute
        // outlive the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()?
        };
        Ok(())
    }

    /// Loads every kernel module this device supports now instead of at its first use.
    pub fn load_modules(&self) -> Result<()> {
        for m in MODULES
            .iter()
            .filter(|m| m.variant.is_none() && self.supports_module(m.name))
        {
            self.module(m.name)?;
        }
        Ok(())
    }

    fn module(&self, name: &'static str) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules.lock().unwrap().get(name) {
            return Ok(m.clone());
        }
        let spec = MODULES
            .iter()
            .find(|m| m.name == name)
            .ok_or_else(|| CudaError::Module {
                module: name.into(),
                reason: "unknown module".into(),
            })?;
        if !self.supports_module(name) {
            return Err(CudaError::Module {
                module: name.into(),
                reason: format!(
                    "built for compute capability {:?} only; this device is {:?}",
                    spec.only_on, self.compute
                ),
            });
        }
        if let Some(module) = self.module_from_dir(spec)? {
            self.modules.lock().unwrap().insert(name, module.clone());
            return Ok(module);
        }
        // PTX built from an older source (a kernel edited since `cargo xtask kernels`) would run
        // old code or lack new kernels: the source itself is compiled instead.
        let loaded = match crate::ptx::is_current(spec) {
            true => self
                .ctx
                .load_module(Ptx::from_src(spec.ptx))
                .map_err(|e| e.to_string()),
            false => {
                tracing::warn!(
                    "kernels/{name}.cu changed since its PTX was built: compiling it with NVRTC"
                );
                Err("the committed PTX is older than its source".into())
            }
        };
        let module = match loaded {
            Ok(m) => m,
            Err(ptx_err) => self
                .compile_with_nvrtc(spec)
                .map_err(|reason| CudaError::Module {
                    module: name.into(),
                    reason: format!(
                        "committed PTX failed ({ptx_err}) and NVRTC failed too: {reason}"
                    ),
                })?,
        };
        self.modules.lock().unwrap().insert(name, module.clone());
        Ok(module)
    }

    /// `spec`'s module from the directory [`KERNELS_DIR_ENV`] names, if any: its `NAME.ptx` when
    /// there is one, else its `NAME.cu` (with that directory's `common.cuh`) compiled by NVRTC;
    /// `None` when the directory has neither.
    fn module_from_dir(&self, spec: &KernelModule) -> Result<Option<Arc<CudaModule>>> {
        let Some(dir) = std::env::var_os(KERNELS_DIR_ENV) else {
            return Ok(None);
        };
        let (name, dir) = (spec.name, Path::new(&dir));
        let fail = |reason: String| CudaError::Module {
            module: name.into(),
            reason: format!("{KERNELS_DIR_ENV}={}: {reason}", dir.display()),
        };
        let read = |file: &str| std::fs::read_to_string(dir.join(file));
        if let Ok(ptx) = read(&format!("{name}.ptx")) {
            tracing::warn!("kernel module {name}: PTX from {}", dir.display());
            let module = self.ctx.load_module(Ptx::from_src(ptx));
            return module.map(Some).map_err(|e| fail(e.to_string()));
        }
        let Ok(source) = read(&format!("{}.cu", spec.file)) else {
            return Ok(None);
        };
        let header = read("common.cuh").map_err(|e| fail(format!("common.cuh: {e}")))?;
        tracing::warn!("kernel module {name}: NVRTC from {}", dir.display());
        let module = self.compile_source_with_nvrtc(spec, &source, &header);
        module.map(Some).map_err(fail)
    }

    fn compile_with_nvrtc(
        &self,
        spec: &KernelModule,
    ) -> std::result::Result<Arc<CudaModule>, String> {
        self.compile_source_with_nvrtc(spec, spec.source, crate::ptx::COMMON_HEADER)
    }

    fn compile_source_with_nvrtc(
        &self,
        spec: &KernelModule,
        source: &str,
        header: &str,
    ) -> std::result::Result<Arc<CudaModule>, String> {
        let (major, minor) = self.compute;
        // Architecture-specific modules need the "a" target of their architecture.
        let suffix = if spec.only_on.is_some() { "a" } else { "" };
        // NVRTC cannot read files: splice the shared header in place of its #include.
        // Nor does it ship the C library's headers: the fixed-width types and INFINITY are defined here.
        let header = header.replace(
            "#include <stdint.h>",
            "typedef unsigned char uint8_t; typedef unsigned short uint16_t; \
             typedef unsigned int uint32_t; typedef unsigned long long uint64_t; \
             typedef int int32_t; typedef long long int64_t; typedef unsigned long long uintptr_t;\n\
             #ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif",
        );
        let source = spec
            .source_with_variant(source)
            .replace("#include \"common.cuh\"", &header);
        let opts = cudarc::nvrtc::CompileOptions {
            arch: Some(Box::leak(
                format!("compute_{major}{minor}{suffix}").into_boxed_str(),
            )),
            include_paths: vec!["/usr/local/cuda/include".into()],
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| e.to_string())?;
        self.ctx.load_module(ptx).map_err(|e| e.to_string())
    }
}
