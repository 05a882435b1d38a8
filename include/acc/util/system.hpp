#pragma once
// What the machine offers this process: memory and cores. Containers and batch schedulers limit
// both below what /proc/meminfo and nproc report, so each figure is the smaller of the machine's
// and its cgroup's (v2 files, or v1 where that hierarchy is mounted; the smallest limit on the path
// from the process's cgroup up to the root of the mount, since every ancestor's limit applies).
//
// Linux only. Read fresh on every call (a few small files); nothing is cached, since available
// memory changes while a program runs.

#include <cstdint>
#include <vector>

namespace acc {

/// MemTotal of /proc/meminfo, or the cgroup's memory limit when that is lower. Throws
/// acc::IoError when /proc/meminfo cannot be read.
int64_t physical_memory_bytes();

/// MemAvailable of /proc/meminfo (what can be allocated without swapping), or, when lower, what
/// the cgroup's limit leaves above the cgroup's current usage (0 when at or over it). Throws
/// acc::IoError when /proc/meminfo cannot be read.
int64_t available_memory_bytes();

/// CPUs this process may run on (sched_getaffinity), or fewer when a cgroup CPU quota allows
/// less (cpu.max or cpu.cfs_quota_us / cpu.cfs_period_us, rounded up). At least 1. One process's
/// view: under mpirun's default binding each rank sees only its own cores
/// (acc::dist::node_cores counts a node's ranks together).
int usable_cores();

/// The CPUs this process may run on (sched_getaffinity), by number; {} when it cannot be read.
std::vector<int> affinity_cpus();

/// `cores` capped by this process's cgroup CPU quota (rounded up), at least 1.
int capped_by_cpu_quota(int cores);

/// Cores of this machine the job may use: online CPUs, the cgroup quota applied, this process's
/// affinity not (mpirun binds each rank to a share of them). What describes the machine, where
/// usable_cores() describes one process of a job on it.
int machine_cores();

}  // namespace acc
