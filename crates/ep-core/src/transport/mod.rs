//! The `Transport` trait: the host face (collective allocation, reachability, QPs, phases) and
//! the protocol vocabulary both backends implement (`DESIGN.md`, "One logic, two executors").
