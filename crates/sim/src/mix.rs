//! Seed 004's mix in a run's results: the run's metrics per workload (A chat, B
//! summarisation, C reasoning), over the same window and with the same definitions as the
//! whole run's ([`crate::metrics`]), from the run's request records.

use nanotime::Nanos;
use report::ClassRow;
use workload::Class;

use crate::metrics::{RequestRecord, WindowAcc};

/// One row per class that has a request in `(from, to]`, in A, B, C order. `class_of` tells a
/// record's class from its conversation (`crate::chat::Chat::class_of`). Output tokens per
/// second count the output of requests finished in the window (the per-token emission times
/// are not kept per class).
pub fn per_class(
    records: &[RequestRecord],
    from: Nanos,
    to: Nanos,
    oracle: bool,
    class_of: impl Fn(u64) -> Class,
) -> Vec<ClassRow> {
    let mut accs: [WindowAcc; 3] = std::array::from_fn(|_| WindowAcc::new(from, to));
    let mut output = [0u64; 3];
    let mut touched = [false; 3];
    for r in records {
        let k = class_of(r.conversation) as usize;
        if accs[k].touches(r) {
            touched[k] = true;
            if r.ended_at > from && r.ended_at <= to && r.outcome == crate::Outcome::Finished {
                output[k] += u64::from(r.output_tokens);
            }
        }
        accs[k].add(r);
    }
    Class::ALL
        .into_iter()
        .zip(accs)
        .zip(output)
        .filter(|((class, _), _)| touched[*class as usize])
        .map(|((class, mut acc), out)| {
            acc.tokens = out;
            ClassRow {
                class: class.letter().to_owned(),
                name: class.name().to_owned(),
                metrics: acc.metrics(oracle).rounded(),
            }
        })
        .collect()
}
