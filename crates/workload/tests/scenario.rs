//! The scenario controller walks seed 004's cycle: phases in order with their durations,
//! mixes, rates and scaling actions; the loop; the ramp; bad files refused naming the field.

use nanotime::Nanos;
use workload::Mix;
use workload::scenario::{
    PoolChange, PoolKind, PoolSizes, SEED004_TOML, ScenarioAction, ScenarioConfig,
    ScenarioController, ScenarioError,
};

fn names(actions: &[ScenarioAction]) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            ScenarioAction::EnterPhase { name, .. } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

/// Runs the controller from 0 to `end`, collecting (time, action).
fn drive(controller: &mut ScenarioController, end: Nanos) -> Vec<(Nanos, ScenarioAction)> {
    let mut out = Vec::new();
    for a in controller.start(Nanos::ZERO, None).unwrap() {
        out.push((Nanos::ZERO, a));
    }
    while let Some(at) = controller.poll_timeout() {
        if at > end {
            break;
        }
        for a in controller.handle_timeout(at) {
            out.push((at, a));
        }
    }
    out
}

#[test]
fn the_seed_cycle_takes_thirteen_minutes_in_the_seed_order() {
    let config = ScenarioConfig::seed004();
    assert_eq!(config.cycle_s(), 780.0);
    let mut controller = ScenarioController::new(config).unwrap();
    let actions = drive(&mut controller, Nanos::from_secs(780));
    let entered: Vec<(f64, String)> = actions
        .iter()
        .filter_map(|(at, a)| match a {
            ScenarioAction::EnterPhase { name, .. } => Some((at.as_secs_f64(), name.clone())),
            _ => None,
        })
        .collect();
    let expected = [
        (0.0, "BALANCED"),
        (120.0, "KV_CACHE_DEMO"),
        (240.0, "PREFILL_STRESS"),
        (330.0, "PREFILL_RECOVERY"),
        (420.0, "DECODE_STRESS"),
        (510.0, "DECODE_RECOVERY"),
        (600.0, "FULL_LOAD"),
        (720.0, "COOLDOWN"),
        (780.0, "BALANCED"),
    ];
    let expected: Vec<(f64, String)> = expected.iter().map(|(t, n)| (*t, n.to_string())).collect();
    assert_eq!(entered, expected);
    // The second BALANCED is cycle 1.
    assert!(actions.iter().any(|(_, a)| matches!(
        a,
        ScenarioAction::EnterPhase { name, cycle: 1, .. } if name == "BALANCED"
    )));
}

#[test]
fn scaling_actions_add_workers_then_reset_to_the_initial_ratio() {
    let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
    let actions = drive(&mut controller, Nanos::from_secs(780));
    let scales: Vec<(u64, PoolKind, u32)> = actions
        .iter()
        .filter_map(|(at, a)| match a {
            ScenarioAction::Scale { pool, to } => Some((at.as_nanos() / 1_000_000_000, *pool, *to)),
            _ => None,
        })
        .collect();
    assert_eq!(
        scales,
        vec![
            (0, PoolKind::Prefill, 1),
            (0, PoolKind::Decode, 1),
            (330, PoolKind::Prefill, 2),
            (510, PoolKind::Decode, 2),
            (720, PoolKind::Prefill, 1),
            (720, PoolKind::Decode, 1),
            (780, PoolKind::Prefill, 1),
            (780, PoolKind::Decode, 1),
        ]
    );
}

#[test]
fn mixes_follow_the_seed_table() {
    let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
    controller
        .start(Nanos::ZERO, Some("PREFILL_STRESS"))
        .unwrap();
    assert_eq!(
        controller.status(Nanos::from_secs(30)).mix,
        Some(Mix::new(0, 80, 20).unwrap())
    );
    let actions = controller.handle_timeout(Nanos::from_secs(180));
    assert_eq!(names(&actions), ["PREFILL_RECOVERY", "DECODE_STRESS"]);
    assert!(actions.contains(&ScenarioAction::SetMix(Mix::new(0, 20, 80).unwrap())));
    let status = controller.status(Nanos::from_secs(200));
    assert_eq!(status.phase, "DECODE_STRESS");
    assert!((status.time_left_s - 70.0).abs() < 1e-9);
    assert_eq!(
        status.pools,
        Some(PoolSizes {
            prefill: 2,
            decode: 1
        })
    );
}

#[test]
fn cooldown_ramps_the_rate_down_to_zero() {
    let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
    let actions = drive(&mut controller, Nanos::from_secs(780));
    let rates: Vec<(f64, f64)> = actions
        .iter()
        .filter(|(at, _)| *at >= Nanos::from_secs(720))
        .filter_map(|(at, a)| match a {
            ScenarioAction::SetRate(r) => Some((at.as_secs_f64(), *r)),
            _ => None,
        })
        .collect();
    // Every 5 s from 725 to 775, then exactly 0 at 780, then BALANCED's 0.6.
    assert_eq!(rates.len(), 13, "{rates:?}");
    assert!((rates[0].1 - 0.6 * 55.0 / 60.0).abs() < 1e-9, "{rates:?}");
    assert!(rates.windows(2).take(11).all(|w| w[1].1 < w[0].1));
    assert_eq!(rates[11], (780.0, 0.0));
    assert_eq!(rates[12], (780.0, 0.6));
}

#[test]
fn a_late_wake_catches_up_phase_by_phase() {
    let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
    controller.start(Nanos::ZERO, None).unwrap();
    // Asleep for 5 minutes: both missed phase changes happen, in order.
    let actions = controller.handle_timeout(Nanos::from_secs(300));
    assert_eq!(names(&actions), ["KV_CACHE_DEMO", "PREFILL_STRESS"]);
    assert_eq!(controller.poll_timeout(), Some(Nanos::from_secs(330)));
}

#[test]
fn stopped_controller_is_idle() {
    let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
    controller.start(Nanos::ZERO, None).unwrap();
    controller.stop();
    assert_eq!(controller.poll_timeout(), None);
    assert_eq!(controller.status(Nanos::ZERO).phase, "IDLE");
    assert!(controller.handle_timeout(Nanos::from_secs(999)).is_empty());
}

#[test]
fn an_unknown_start_phase_names_the_field_and_the_phases() {
    let mut controller = ScenarioController::new(ScenarioConfig::seed004()).unwrap();
    let err = controller.start(Nanos::ZERO, Some("LUNCH")).unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("phase: unknown phase `LUNCH`"),
        "{message}"
    );
    assert!(message.contains("PREFILL_STRESS"), "{message}");
}

#[test]
fn bad_files_are_refused_naming_the_field() {
    let edit = |from: &str, to: &str| {
        assert!(SEED004_TOML.contains(from), "{from}");
        ScenarioConfig::from_toml(&SEED004_TOML.replacen(from, to, 1)).unwrap_err()
    };
    assert!(matches!(
        edit(
            "mix = { A = 40, B = 30, C = 30 }",
            "mix = { A = 40, B = 30, C = 20 }"
        ),
        ScenarioError::MixTotal { total: 90, .. }
    ));
    assert!(
        edit("rate_rps = 0.6\n# The", "rate_rps = -1.0\n# The")
            .to_string()
            .starts_with("rate_rps:")
    );
    assert!(matches!(
        edit("duration_s = 120", "duration_s = 0"),
        ScenarioError::Duration { .. }
    ));
    assert!(matches!(
        edit("loop_to = \"BALANCED\"", "loop_to = \"NOPE\""),
        ScenarioError::UnknownPhase { .. }
    ));
    assert!(matches!(
        edit("name = \"KV_CACHE_DEMO\"", "name = \"BALANCED\""),
        ScenarioError::DuplicateName(_)
    ));
    assert!(matches!(
        edit("name = \"KV_CACHE_DEMO\"", "name = \"IDLE\""),
        ScenarioError::ReservedName
    ));
    assert!(matches!(
        edit("prefill = \"+1\"", "prefill = \"plus one\""),
        ScenarioError::Toml(_)
    ));
    assert!(matches!(
        edit(
            "initial = { prefill = 1, decode = 1 }",
            "initial = { prefill = 1, decode = 0 }"
        ),
        ScenarioError::NoDecode
    ));
    assert!(matches!(
        edit(
            "initial = { prefill = 1, decode = 1 }",
            "initial = { prefill = 9, decode = 1 }"
        ),
        ScenarioError::InitialOverMax {
            pool: PoolKind::Prefill,
            ..
        }
    ));
    assert!(matches!(
        edit("duration_s = 120", "duraton_s = 120"),
        ScenarioError::Toml(_)
    ));
}

#[test]
fn pool_changes_read_and_write_the_same_text() {
    for (text, change) in [
        ("keep", PoolChange::Keep),
        ("initial", PoolChange::Initial),
        ("+2", PoolChange::Add(2)),
        ("3", PoolChange::Set(3)),
    ] {
        assert_eq!(text.parse::<PoolChange>().unwrap(), change);
        assert_eq!(change.to_string(), text);
    }
    assert!("-1".parse::<PoolChange>().is_err());
}
