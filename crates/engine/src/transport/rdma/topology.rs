//! NIC priority matrices: which NICs to prefer for a buffer's location.

use std::collections::HashMap;
use std::path::Path;

use crate::json::Value;

/// Where to prefer which NICs: location → (preferred, other) NIC indices.
#[derive(Clone, Debug, Default)]
pub(super) struct Topology {
    by_location: HashMap<String, (Vec<usize>, Vec<usize>)>,
}

impl Topology {
    /// Parses a priority matrix against a NIC list (names not in it are ignored).
    pub(super) fn parse(matrix: &Value, nics: &[String]) -> Topology {
        let index = |v: &Value| v.as_str().and_then(|n| nics.iter().position(|x| x == n));
        let mut by_location = HashMap::new();
        for (loc, lists) in matrix.as_object().unwrap_or(&[]) {
            let list = |i: usize| -> Vec<usize> {
                lists
                    .as_array()
                    .and_then(|a| a.get(i))
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(index).collect())
                    .unwrap_or_default()
            };
            by_location.insert(loc.clone(), (list(0), list(1)));
        }
        Topology { by_location }
    }

    /// NICs for a buffer at `location`: its preferred list (else `*`'s, else all)
    /// and the other usable ones.
    pub(super) fn nics_for(&self, location: &str, count: usize) -> (Vec<usize>, Vec<usize>) {
        let entry = self
            .by_location
            .get(location)
            .or_else(|| self.by_location.get("*"))
            .filter(|(p, _)| !p.is_empty());
        match entry {
            Some((p, o)) => {
                let mut other: Vec<usize> = o.clone();
                // Every NIC stays usable as a last resort.
                other.extend((0..count).filter(|i| !p.contains(i) && !o.contains(i)));
                (p.clone(), other)
            }
            None => ((0..count).collect(), Vec::new()),
        }
    }

    pub(super) fn to_json(nics: &[String]) -> Value {
        let all: Vec<Value> = nics.iter().map(|n| Value::from(n.as_str())).collect();
        Value::object([(
            "cpu:0",
            Value::Array(vec![Value::Array(all), Value::Array(Vec::new())]),
        )])
    }
}

/// Discovers a priority matrix (Mooncake's format) from this machine's PCI and NUMA
/// layout in `/sys`, for the GPUs the runtime-loaded drivers report.
pub(super) fn discover(nics: &[String]) -> Value {
    discover_in(Path::new("/sys"), nics, &gpus())
}

/// Every GPU the CUDA and HIP drivers see, as (location, PCI address); none when a
/// driver is missing.
fn gpus() -> Vec<(String, String)> {
    let mut found = Vec::new();
    if let Ok(api) = crate::ffi::cuda::api() {
        for i in 0..api.device_count().unwrap_or(0) {
            if let Ok(id) = api.pci_bus_id(i) {
                found.push((format!("cuda:{i}"), id));
            }
        }
    }
    if let Ok(api) = crate::ffi::hip::api() {
        for i in 0..api.device_count().unwrap_or(0) {
            if let Ok(id) = api.pci_bus_id(i) {
                found.push((format!("hip:{i}"), id));
            }
        }
    }
    found
}

/// Where a PCI device sits: its path from the root complex, and its NUMA node.
struct PciPlace {
    path: Vec<String>,
    numa: Option<u32>,
}

impl PciPlace {
    /// `dev` is a sysfs link to a PCI device directory (`/sys/class/infiniband/X/device`,
    /// `/sys/bus/pci/devices/ADDR`).
    fn of(dev: &Path) -> Option<PciPlace> {
        let real = std::fs::canonicalize(dev).ok()?;
        let numa = std::fs::read_to_string(real.join("numa_node"))
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .and_then(|n| u32::try_from(n).ok());
        let path = real
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        Some(PciPlace { path, numa })
    }

    /// Hops between two devices through the bridges and switches above them.
    fn distance(&self, other: &PciPlace) -> usize {
        let common = self
            .path
            .iter()
            .zip(&other.path)
            .take_while(|(a, b)| a == b)
            .count();
        self.path.len() + other.path.len() - 2 * common
    }
}

/// The matrix for `nics` under the sysfs tree at `sysfs`:
/// - `cpu:N` for every NUMA node N: NICs attached to node N preferred, the others next;
/// - each GPU's location: the NICs closest to it on the PCI tree preferred, the other
///   NICs of its NUMA node next.
///
/// When sysfs does not know one of the NICs (emulated devices, no /sys), the layout is
/// unknown and every NIC is preferred for every location.
pub(super) fn discover_in(sysfs: &Path, nics: &[String], gpus: &[(String, String)]) -> Value {
    let places: Option<Vec<PciPlace>> = nics
        .iter()
        .map(|n| PciPlace::of(&sysfs.join("class/infiniband").join(n).join("device")))
        .collect();
    let Some(places) = places else {
        return Topology::to_json(nics);
    };
    let names = |idx: &[usize]| -> Value {
        Value::Array(idx.iter().map(|&i| Value::from(nics[i].as_str())).collect())
    };
    let entry = |preferred: Vec<usize>, other: Vec<usize>| -> Value {
        if preferred.is_empty() {
            let all: Vec<usize> = (0..nics.len()).collect();
            Value::Array(vec![names(&all), Value::Array(Vec::new())])
        } else {
            Value::Array(vec![names(&preferred), names(&other)])
        }
    };
    let mut nodes: Vec<u32> = std::fs::read_dir(sysfs.join("devices/system/node"))
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    name.strip_prefix("node")?.parse().ok()
                })
                .collect()
        })
        .unwrap_or_default();
    nodes.sort_unstable();
    if nodes.is_empty() {
        nodes.push(0);
    }
    let mut matrix = Vec::new();
    for node in nodes {
        let (on, off): (Vec<usize>, Vec<usize>) =
            (0..nics.len()).partition(|&i| places[i].numa == Some(node));
        matrix.push((format!("cpu:{node}"), entry(on, off)));
    }
    for (location, bus_id) in gpus {
        let dev = sysfs
            .join("bus/pci/devices")
            .join(bus_id.to_ascii_lowercase());
        let Some(gpu) = PciPlace::of(&dev) else {
            continue;
        };
        let nearest = places.iter().map(|p| p.distance(&gpu)).min().unwrap_or(0);
        let (close, rest): (Vec<usize>, Vec<usize>) =
            (0..nics.len()).partition(|&i| places[i].distance(&gpu) == nearest);
        let same_node = rest
            .into_iter()
            .filter(|&i| gpu.numa.is_some() && places[i].numa == gpu.numa)
            .collect();
        matrix.push((location.clone(), entry(close, same_node)));
    }
    Value::Object(matrix)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    /// A sysfs tree: two NUMA nodes; root complex 0 holds a switch with mlx5_0 and a
    /// GPU at 0000:10:00.0, and mlx5_1 on its own port; root complex 1 holds mlx5_2
    /// and a GPU at 0000:11:00.0.
    fn fake_sysfs() -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "mc-sysfs-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let devices = root.join("devices");
        let place = |pci: &str, numa: i32| -> PathBuf {
            let d = devices.join(pci);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("numa_node"), format!("{numa}\n")).unwrap();
            d
        };
        let nic = |name: &str, dir: &Path| {
            let c = root.join("class/infiniband").join(name);
            std::fs::create_dir_all(&c).unwrap();
            std::os::unix::fs::symlink(dir, c.join("device")).unwrap();
        };
        let gpu = |addr: &str, dir: &Path| {
            let b = root.join("bus/pci/devices");
            std::fs::create_dir_all(&b).unwrap();
            std::os::unix::fs::symlink(dir, b.join(addr)).unwrap();
        };
        let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
        nic(
            "mlx5_0",
            &place(&format!("{sw}/0000:02:00.0/0000:03:00.0"), 0),
        );
        gpu(
            "0000:10:00.0",
            &place(&format!("{sw}/0000:02:01.0/0000:10:00.0"), 0),
        );
        nic("mlx5_1", &place("pci0000:00/0000:00:02.0/0000:04:00.0", 0));
        nic("mlx5_2", &place("pci0000:80/0000:80:01.0/0000:81:00.0", 1));
        gpu(
            "0000:11:00.0",
            &place("pci0000:80/0000:80:02.0/0000:11:00.0", 1),
        );
        for n in ["node0", "node1"] {
            std::fs::create_dir_all(root.join("devices/system/node").join(n)).unwrap();
        }
        root
    }

    #[test]
    fn discovery_prefers_numa_local_and_pci_close_nics() {
        let root = fake_sysfs();
        let nics: Vec<String> = ["mlx5_0", "mlx5_1", "mlx5_2"].map(String::from).to_vec();
        let gpus = [
            ("cuda:0".to_owned(), "0000:10:00.0".to_owned()),
            ("cuda:1".to_owned(), "0000:11:00.0".to_owned()),
            ("cuda:2".to_owned(), "0000:99:00.0".to_owned()),
        ];
        let m = discover_in(&root, &nics, &gpus);
        assert_eq!(
            m.to_string(),
            r#"{"cpu:0":[["mlx5_0","mlx5_1"],["mlx5_2"]],"cpu:1":[["mlx5_2"],["mlx5_0","mlx5_1"]],"cuda:0":[["mlx5_0"],["mlx5_1"]],"cuda:1":[["mlx5_2"],[]]}"#,
            "a GPU sysfs does not know is left out"
        );
        // What the transport makes of it: cuda:0 → mlx5_0 first, mlx5_1, then mlx5_2.
        let t = Topology::parse(&m, &nics);
        assert_eq!(t.nics_for("cuda:0", 3), (vec![0], vec![1, 2]));
        assert_eq!(t.nics_for("cpu:1", 3), (vec![2], vec![0, 1]));

        // A NIC sysfs does not know (emulated): layout unknown, every NIC preferred.
        let mut with_unknown = nics.clone();
        with_unknown.push("emu0".into());
        let m = discover_in(&root, &with_unknown, &gpus);
        assert_eq!(
            m.to_string(),
            r#"{"cpu:0":[["mlx5_0","mlx5_1","mlx5_2","emu0"],[]]}"#
        );
        std::fs::remove_dir_all(&root).unwrap();
    }
}
