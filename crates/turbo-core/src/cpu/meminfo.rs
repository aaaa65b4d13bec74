//! Available host memory, for sizing the CPU backend's KV cache as a fraction of it.

/// `MemAvailable` of `/proc/meminfo` in bytes: what the kernel estimates can be allocated without
/// swapping (free memory plus reclaimable page cache). `None` where there is no such file.
pub(crate) fn mem_available() -> Option<usize> {
    parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

fn parse_mem_available(meminfo: &str) -> Option<usize> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let kib: usize = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_mem_available() {
        let text = "MemTotal:       24683656 kB\nMemFree:        23763028 kB\n\
                    MemAvailable:   24229932 kB\nBuffers:            2104 kB\n";
        assert_eq!(parse_mem_available(text), Some(24229932 * 1024));
        assert_eq!(parse_mem_available("MemFree: 1 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots\n"), None);
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn reads_this_machine() {
        assert!(mem_available().is_some_and(|b| b > 0));
    }
}
