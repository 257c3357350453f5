//! The CPU time of this process's own threads, read from `/proc` (Linux): what a bench charges
//! to the runtime it measures. Shared by the gateway's and the load generator's benches
//! (`#[path]`).

/// CPU seconds (user + system) used so far by this process's threads whose name `matches`;
/// NaN where `/proc` cannot be read.
pub fn thread_cpu_seconds(matches: impl Fn(&str) -> bool) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    // SAFETY: sysconf has no preconditions.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let mut ticks = 0u64;
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if !matches(comm.trim()) {
            continue;
        }
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // Fields after the parenthesised name: state is field 3, utime 14, stime 15.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
        ticks += field(11).unwrap_or(0) + field(12).unwrap_or(0);
    }
    ticks as f64 / ticks_per_s
}
