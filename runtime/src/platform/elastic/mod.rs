//! Elastic memory: a budget that changes while the model runs, the way a phone's OS takes memory
//! back from an app and gives it again. This module finds where the budget comes from and
//! watches it; the streaming model re-plans for each new value between tokens.

pub mod cgroup_limit;
pub mod pressure;
pub mod watch;

pub use cgroup_limit::{GroupMemory, Groups};
pub use pressure::{Pressure, PressureSignals};
pub use watch::{auto_budget, read_budget, BudgetHandle, BudgetSource, BudgetWatch};
