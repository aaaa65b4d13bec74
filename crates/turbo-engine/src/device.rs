/// Where to compute: `auto` (CUDA when a GPU is present, else the CPU), `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl Device {
    /// The device `Auto` stands for on this machine; any other device as it is.
    pub fn resolve(self) -> Device {
        match self {
            Device::Auto if turbo_kernels::cuda_available() => Device::Cuda(0),
            Device::Auto => Device::Cpu,
            d => d,
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    format!("unknown device '{s}' (expected auto, cpu, cuda or cuda:N)")
                }),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Auto => write!(f, "auto"),
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}
