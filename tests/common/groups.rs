//! Mooncake PG groups for in-process tests: one per rank, connected to each other.

use mooncake::collective::{Group, GroupOptions};

/// `world` groups in this process, each rank's options adjusted by `tweak`, connected.
pub fn connected_groups(world: usize, tweak: impl Fn(&mut GroupOptions)) -> Vec<Group> {
    let groups: Vec<Group> = (0..world)
        .map(|r| {
            let mut o = GroupOptions::new(r, world);
            tweak(&mut o);
            Group::new(o).expect("group starts")
        })
        .collect();
    let addrs: Vec<String> = groups.iter().map(Group::address).collect();
    for g in &groups {
        g.connect(&addrs).expect("connect");
    }
    groups
}
