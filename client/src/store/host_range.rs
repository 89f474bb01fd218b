//! Whether a range a caller registers is host memory this process can read and
//! write. Engines register what they have: vLLM hands over the `data_ptr()` of its
//! GPU KV-cache tensors, addresses that the CPU cannot touch (CUDA reserves them
//! in the process's address space without access). Dereferencing one on the
//! CPU crashes the process, so a registration is checked against the kernel's
//! map of the process (`/proc/self/maps`) first and refused with the reason.

use std::fmt;

/// Why a range is not usable host memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostRangeError {
    /// Part of the range is mapped without read and write access (device memory
    /// that a GPU runtime reserved, a guard page, read-only memory).
    #[error("{at:#x} is mapped {perms} ({what}), not readable and writable host memory")]
    NoAccess {
        /// The first address without access.
        at: usize,
        /// The mapping's permissions as the kernel prints them (`---p`, `r--p`).
        perms: String,
        /// What is mapped there (the mapping's path, or "anonymous").
        what: String,
    },
    /// Part of the range is not mapped at all.
    #[error("{at:#x} is not mapped in this process")]
    Unmapped {
        /// The first unmapped address.
        at: usize,
    },
    /// The process's map could not be read.
    #[error("reading /proc/self/maps: {0}")]
    Unreadable(String),
}

/// One line of `/proc/<pid>/maps`.
struct Mapping<'a> {
    start: usize,
    end: usize,
    perms: &'a str,
    path: &'a str,
}

impl fmt::Debug for Mapping<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}-{:#x} {}", self.start, self.end, self.perms)
    }
}

fn parse(line: &str) -> Option<Mapping<'_>> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    // offset, device, inode, then the path (which may hold spaces).
    let path = line
        .splitn(6, char::is_whitespace)
        .filter(|field| !field.is_empty())
        .nth(5)
        .unwrap_or("")
        .trim();
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        perms,
        path,
    })
}

/// Checks that `[start, start + len)` is covered by mappings readable and
/// writable, given the text of `/proc/<pid>/maps` (sorted by address, as the
/// kernel prints it).
///
/// # Errors
/// The first address that is unmapped or mapped without access.
pub fn check_in_maps(maps: &str, start: usize, len: usize) -> Result<(), HostRangeError> {
    let end = start.saturating_add(len);
    let mut at = start;
    for mapping in maps.lines().filter_map(parse) {
        if at >= end {
            break;
        }
        if mapping.end <= at {
            continue;
        }
        if mapping.start > at {
            return Err(HostRangeError::Unmapped { at });
        }
        let perms = mapping.perms.as_bytes();
        if perms.first() != Some(&b'r') || perms.get(1) != Some(&b'w') {
            return Err(HostRangeError::NoAccess {
                at,
                perms: mapping.perms.to_owned(),
                what: if mapping.path.is_empty() {
                    "anonymous".to_owned()
                } else {
                    mapping.path.to_owned()
                },
            });
        }
        at = mapping.end;
    }
    if at < end {
        return Err(HostRangeError::Unmapped { at });
    }
    Ok(())
}

/// Checks that `[start, start + len)` is host memory this process can read and
/// write, against its current map.
///
/// # Errors
/// As [`check_in_maps`]; [`HostRangeError::Unreadable`] when the map cannot be
/// read (no `/proc`).
pub fn check_host_range(start: usize, len: usize) -> Result<(), HostRangeError> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|error| HostRangeError::Unreadable(error.to_string()))?;
    check_in_maps(&maps, start, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0a00000-55d0c0a21000 r--p 00000000 08:01 1234    /usr/bin/python3.11
7f0000000000-7f0000100000 rw-p 00000000 00:00 0 
7f0000100000-7f0000200000 rw-s 00000000 00:01 77    /memfd:hkvm-host (deleted)
7f0000200000-7f0000300000 ---p 00000000 00:00 0 
7f0000400000-7f0000500000 rw-p 00000000 00:00 0 
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0     [stack]
";

    #[test]
    fn adjacent_writable_mappings_cover_a_range() {
        assert_eq!(check_in_maps(MAPS, 0x7f00_0000_0000, 0x10_0000), Ok(()));
        // Across a private and a shared mapping.
        assert_eq!(check_in_maps(MAPS, 0x7f00_000f_f000, 0x2000), Ok(()));
        assert_eq!(check_in_maps(MAPS, 0x7ffd_0000_0000, 8), Ok(()));
    }

    #[test]
    fn reserved_device_like_memory_is_refused_with_its_permissions() {
        let error = check_in_maps(MAPS, 0x7f00_0020_0000, 4096).unwrap_err();
        assert_eq!(
            error,
            HostRangeError::NoAccess {
                at: 0x7f00_0020_0000,
                perms: "---p".into(),
                what: "anonymous".into()
            }
        );
        // A range that runs from writable memory into the reservation.
        assert!(matches!(
            check_in_maps(MAPS, 0x7f00_001f_f000, 0x2000),
            Err(HostRangeError::NoAccess {
                at: 0x7f00_0020_0000,
                ..
            })
        ));
        // Read-only memory with a path.
        let error = check_in_maps(MAPS, 0x55d0_c0a0_0000, 16).unwrap_err();
        assert!(error.to_string().contains("/usr/bin/python3.11"), "{error}");
    }

    #[test]
    fn unmapped_addresses_and_gaps_are_refused() {
        assert_eq!(
            check_in_maps(MAPS, 0x1000, 16),
            Err(HostRangeError::Unmapped { at: 0x1000 })
        );
        // The gap between 0x7f0000300000 and 0x7f0000400000.
        assert_eq!(
            check_in_maps(MAPS, 0x7f00_0030_0000, 16),
            Err(HostRangeError::Unmapped {
                at: 0x7f00_0030_0000
            })
        );
        // Past the last mapping.
        assert_eq!(
            check_in_maps(MAPS, 0x7ffd_0002_0000, 0x2000),
            Err(HostRangeError::Unmapped {
                at: 0x7ffd_0002_1000
            })
        );
    }

    #[test]
    fn this_process_heap_is_host_memory_and_a_reservation_is_not() {
        let buffer = vec![7u8; 1 << 20];
        assert_eq!(
            check_host_range(buffer.as_ptr() as usize, buffer.len()),
            Ok(())
        );
        // SAFETY: an anonymous PROT_NONE reservation, as a GPU runtime makes for
        // device memory; unmapped below.
        let reserved = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                1 << 20,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(reserved, libc::MAP_FAILED);
        let result = check_host_range(reserved as usize, 1 << 20);
        // SAFETY: mapped above with this length.
        unsafe { libc::munmap(reserved, 1 << 20) };
        assert!(
            matches!(result, Err(HostRangeError::NoAccess { ref perms, .. }) if perms == "---p"),
            "{result:?}"
        );
    }
}
