//! Mooncake's segment descriptor and RPC address records, to and from JSON.

use crate::device::IpcExport;
use crate::error::{Code, Error, Result};
use crate::json::{self, Value};
use crate::registry::Access;
use crate::util::hex;

/// Our extension to the descriptor, ignored by Mooncake peers: what a same-host peer
/// needs to move bytes without the network (see `transport::shm`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostInfo {
    /// `/proc/sys/kernel/random/boot_id` plus the PID namespace: equal means same host view.
    pub host_id: String,
    /// The owner's process id.
    pub pid: u32,
    /// Descriptor of the shared guard page in the owner's fd table.
    pub guard_fd: i32,
    /// Descriptor of the owner's range table (what peers may touch, written only by
    /// the owner) in its fd table; -1 when not published.
    pub ranges_fd: i32,
    /// Random value written into the guard page; proves the page belongs to this segment.
    pub token: u64,
    /// The owner's generation (bumped on every unregistration) when it published this;
    /// copiers read the live one from the guard page.
    pub generation: u64,
}

/// One RDMA device a segment can be reached through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceDesc {
    /// Device name (`mlx5_0`, ...).
    pub name: String,
    /// InfiniBand local identifier (0 on RoCE).
    pub lid: u16,
    /// Port GID as 32 hex digits.
    pub gid: String,
}

/// One registered buffer a segment exposes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferDesc {
    /// The location (`cpu:0`, `cuda:1`, ...).
    pub name: String,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length in bytes.
    pub length: u64,
    /// Remote keys, one per entry of the segment's `devices`.
    pub rkey: Vec<u32>,
    /// Local keys, one per entry of the segment's `devices`.
    pub lkey: Vec<u32>,
    /// Our extension: the owner's memfd for this buffer, mappable by same-host peers.
    pub shm_fd: Option<i32>,
    /// Our extension, for device memory: the CUDA/HIP IPC handle same-host peers open.
    pub ipc: Option<IpcExport>,
    /// Our extension (`mc_access`, present unless read-write): what peers may do with
    /// the buffer. Cooperating peers honour it; the owner's servers enforce it.
    pub access: Access,
}

impl BufferDesc {
    /// True when `[addr, addr + len)` lies inside this buffer.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.addr.saturating_add(self.length))
    }
}

/// A segment's descriptor as published in the metadata store (Mooncake's JSON).
#[derive(Clone, Debug, PartialEq)]
pub struct SegmentDesc {
    /// The segment name.
    pub name: String,
    /// The transport the owner was started with (`tcp`, `rdma`, ...).
    pub protocol: String,
    /// Port of the owner's TCP data server.
    pub tcp_data_port: u16,
    /// Host of the TCP data server, when it differs from the segment name's host.
    pub tcp_data_host: Option<String>,
    /// Version of the TCP data protocol the owner speaks.
    pub tcp_proto_version: u32,
    /// When the descriptor was written.
    pub timestamp: String,
    /// RDMA devices the segment is reachable through.
    pub devices: Vec<DeviceDesc>,
    /// Kept as raw JSON: only RDMA/EFA transports interpret it.
    pub priority_matrix: Value,
    /// Registered buffers.
    pub buffers: Vec<BufferDesc>,
    /// Same-host identity, for shared-memory transfers (our extension).
    pub host: Option<HostInfo>,
}

impl SegmentDesc {
    /// An empty descriptor for segment `name`.
    pub fn new(name: &str) -> SegmentDesc {
        SegmentDesc {
            name: name.to_owned(),
            protocol: "tcp".to_owned(),
            tcp_data_port: 0,
            tcp_data_host: None,
            tcp_proto_version: 2,
            timestamp: String::new(),
            devices: Vec::new(),
            priority_matrix: Value::Object(Vec::new()),
            buffers: Vec::new(),
            host: None,
        }
    }

    /// The published buffer that holds all of `[addr, addr+len)`.
    pub fn buffer_for(&self, addr: u64, len: u64) -> Option<&BufferDesc> {
        self.buffers.iter().find(|b| b.contains(addr, len))
    }

    /// The descriptor in Mooncake's JSON form.
    pub fn to_json(&self) -> Value {
        let buffers = self
            .buffers
            .iter()
            .map(|b| {
                let mut fields = vec![
                    ("name", Value::from(b.name.as_str())),
                    ("addr", b.addr.into()),
                    ("length", b.length.into()),
                    ("rkey", keys(&b.rkey)),
                    ("lkey", keys(&b.lkey)),
                ];
                if let Some(fd) = b.shm_fd {
                    fields.push(("mc_shm_fd", fd.into()));
                }
                if b.access != Access::ReadWrite {
                    fields.push(("mc_access", b.access.name().into()));
                }
                if let Some(ipc) = &b.ipc {
                    fields.push(("mc_ipc_handle", hex::encode(&ipc.handle).into()));
                    fields.push(("mc_ipc_offset", ipc.offset.into()));
                }
                Value::object(fields)
            })
            .collect::<Vec<_>>();
        let devices = self
            .devices
            .iter()
            .map(|d| {
                Value::object([
                    ("name", Value::from(d.name.as_str())),
                    ("lid", d.lid.into()),
                    ("gid", d.gid.as_str().into()),
                ])
            })
            .collect::<Vec<_>>();
        let mut fields = vec![
            ("name", Value::from(self.name.as_str())),
            ("protocol", self.protocol.as_str().into()),
            ("tcp_data_port", self.tcp_data_port.into()),
            ("tcp_proto_version", self.tcp_proto_version.into()),
            ("timestamp", self.timestamp.as_str().into()),
            ("devices", devices.into()),
            ("priority_matrix", self.priority_matrix.clone()),
            ("buffers", buffers.into()),
        ];
        if let Some(h) = &self.tcp_data_host {
            fields.push(("tcp_data_host", h.as_str().into()));
        }
        if let Some(h) = &self.host {
            fields.push((
                "mc_host",
                Value::object([
                    ("host_id", Value::from(h.host_id.as_str())),
                    ("pid", h.pid.into()),
                    ("guard_fd", (h.guard_fd as i64).into()),
                    ("ranges_fd", (h.ranges_fd as i64).into()),
                    ("token", h.token.into()),
                    ("generation", h.generation.into()),
                ]),
            ));
        }
        Value::object(fields)
    }

    /// Parses a descriptor from untrusted JSON. Unknown fields are ignored; missing
    /// optional fields take Mooncake's defaults.
    pub fn from_json(v: &Value) -> Result<SegmentDesc> {
        let bad =
            |e: json::FieldError| Error::new(Code::Metadata, format!("segment descriptor: {e}"));
        let name = v.str_field("name").map_err(bad)?.to_owned();
        let mut desc = SegmentDesc::new(&name);
        if let Some(p) = v.get("protocol").and_then(Value::as_str) {
            desc.protocol = p.to_owned();
        }
        if let Some(port) = v.get("tcp_data_port") {
            desc.tcp_data_port = port
                .as_u64()
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| {
                    Error::new(Code::Metadata, "segment descriptor: bad tcp_data_port")
                })?;
        }
        desc.tcp_data_host = v
            .get("tcp_data_host")
            .and_then(Value::as_str)
            .filter(|h| !h.is_empty())
            .map(str::to_owned);
        desc.tcp_proto_version = match v.get("tcp_proto_version") {
            Some(x) => x.as_u64().unwrap_or(1) as u32,
            None => 1,
        };
        desc.timestamp = match v.get("timestamp") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        if let Some(m) = v.get("priority_matrix") {
            desc.priority_matrix = m.clone();
        }
        for d in v.get("devices").and_then(Value::as_array).unwrap_or(&[]) {
            desc.devices.push(DeviceDesc {
                name: d.str_field("name").map_err(bad)?.to_owned(),
                lid: d.get("lid").and_then(Value::as_u64).unwrap_or(0) as u16,
                gid: d
                    .get("gid")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
            });
        }
        for b in v.get("buffers").and_then(Value::as_array).unwrap_or(&[]) {
            let buf = BufferDesc {
                name: b
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_owned(),
                addr: b.u64_field("addr").map_err(bad)?,
                length: b.u64_field("length").map_err(bad)?,
                rkey: parse_keys(b.get("rkey")),
                lkey: parse_keys(b.get("lkey")),
                shm_fd: b
                    .get("mc_shm_fd")
                    .and_then(Value::as_i64)
                    .and_then(|fd| i32::try_from(fd).ok())
                    .filter(|fd| *fd >= 0),
                ipc: parse_ipc(b)?,
                // An access this build does not know is taken as the strictest.
                access: match b.get("mc_access").and_then(Value::as_str) {
                    None => Access::ReadWrite,
                    Some(a) => Access::parse(a).unwrap_or(Access::LocalOnly),
                },
            };
            if buf.addr.checked_add(buf.length).is_none() {
                return Err(Error::new(
                    Code::Metadata,
                    "segment descriptor: buffer overflows",
                ));
            }
            desc.buffers.push(buf);
        }
        if let Some(h) = v.get("mc_host") {
            desc.host = Some(HostInfo {
                host_id: h.str_field("host_id").map_err(bad)?.to_owned(),
                pid: u32::try_from(h.u64_field("pid").map_err(bad)?)
                    .map_err(|_| Error::new(Code::Metadata, "segment descriptor: bad pid"))?,
                guard_fd: fd_field(h, "guard_fd"),
                ranges_fd: fd_field(h, "ranges_fd"),
                token: h.u64_field("token").map_err(bad)?,
                generation: h.u64_field("generation").map_err(bad)?,
            });
        }
        Ok(desc)
    }

    /// Parses Mooncake's JSON form.
    pub fn parse(text: &str) -> Result<SegmentDesc> {
        let v = json::parse(text)
            .map_err(|e| Error::new(Code::Metadata, format!("segment descriptor: {e}")))?;
        SegmentDesc::from_json(&v)
    }
}

/// A descriptor number in `mc_host`; -1 when absent or not one.
fn fd_field(h: &Value, key: &str) -> i32 {
    h.get(key)
        .and_then(Value::as_i64)
        .and_then(|fd| i32::try_from(fd).ok())
        .unwrap_or(-1)
}

/// A buffer's IPC export: both fields or neither; a malformed handle is an error
/// rather than a buffer silently left to slower paths.
fn parse_ipc(b: &Value) -> Result<Option<IpcExport>> {
    let Some(text) = b.get("mc_ipc_handle") else {
        return Ok(None);
    };
    let bad = || Error::new(Code::Metadata, "segment descriptor: bad mc_ipc_handle");
    let bytes = text.as_str().and_then(hex::decode).ok_or_else(bad)?;
    let handle: [u8; 64] = bytes.try_into().map_err(|_| bad())?;
    let offset = b
        .get("mc_ipc_offset")
        .and_then(Value::as_u64)
        .ok_or_else(bad)?;
    Ok(Some(IpcExport { handle, offset }))
}

fn keys(k: &[u32]) -> Value {
    Value::Array(k.iter().map(|&x| Value::from(x)).collect())
}

fn parse_keys(v: Option<&Value>) -> Vec<u32> {
    v.and_then(Value::as_array)
        .unwrap_or(&[])
        .iter()
        .filter_map(|x| x.as_u64().and_then(|k| u32::try_from(k).ok()))
        .collect()
}

/// `mooncake/rpc_meta/<server_name>`: where a server's handshake port listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RpcMeta {
    /// Host the handshake server listens on.
    pub ip_or_host_name: String,
    /// Its port.
    pub rpc_port: u16,
}

impl RpcMeta {
    /// The record in Mooncake's JSON form.
    pub fn to_json(&self) -> Value {
        Value::object([
            (
                "ip_or_host_name",
                Value::from(self.ip_or_host_name.as_str()),
            ),
            ("rpc_port", self.rpc_port.into()),
        ])
    }

    /// Parses Mooncake's JSON form.
    pub fn parse(text: &str) -> Result<RpcMeta> {
        let bad = |e: String| Error::new(Code::Metadata, format!("rpc_meta: {e}"));
        let v = json::parse(text).map_err(|e| bad(e.to_string()))?;
        Ok(RpcMeta {
            ip_or_host_name: v
                .str_field("ip_or_host_name")
                .map_err(|e| bad(e.to_string()))?
                .to_owned(),
            rpc_port: u16::try_from(v.u64_field("rpc_port").map_err(|e| bad(e.to_string()))?)
                .map_err(|_| bad("rpc_port out of range".into()))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptor_round_trip() {
        let mut d = SegmentDesc::new("127.0.0.1:15000");
        d.tcp_data_port = 15001;
        d.tcp_data_host = Some("127.0.0.2".into());
        d.buffers.push(BufferDesc {
            name: "cpu:0".into(),
            addr: 140_737_488_355_328,
            length: 1 << 30,
            rkey: vec![7, 8],
            lkey: vec![],
            shm_fd: Some(9),
            ipc: None,
            access: Access::ReadWrite,
        });
        d.buffers.push(BufferDesc {
            name: "cuda:1".into(),
            addr: 1 << 40,
            length: 1 << 20,
            rkey: vec![],
            lkey: vec![],
            shm_fd: None,
            ipc: Some(IpcExport {
                handle: [0xa5; 64],
                offset: 4096,
            }),
            access: Access::ReadOnly,
        });
        d.host = Some(HostInfo {
            host_id: "abc".into(),
            pid: 42,
            guard_fd: 5,
            ranges_fd: 6,
            token: u64::MAX,
            generation: 3,
        });
        let text = d.to_json().to_string();
        assert!(text.contains("\"addr\":140737488355328"));
        assert_eq!(SegmentDesc::parse(&text).unwrap(), d);
        assert!(d.buffer_for(140_737_488_355_328 + 10, 100).is_some());
        assert!(d.buffer_for(140_737_488_355_328 + (1 << 30), 1).is_none());
        // Read-write (Mooncake's only mode) adds nothing to the wire; an access this
        // build does not know is taken as the strictest.
        assert_eq!(text.matches("mc_access").count(), 1);
        let odd = r#"{"name":"x","buffers":[{"addr":1,"length":2,"mc_access":"later"}]}"#;
        let odd = SegmentDesc::parse(odd).unwrap();
        assert_eq!(odd.buffers[0].access, Access::LocalOnly);
    }

    #[test]
    fn rejects_bad_descriptors() {
        for bad in [
            "{}",
            "[]",
            r#"{"name":"x","buffers":[{"addr":"1","length":2}]}"#,
            r#"{"name":"x","buffers":[{"addr":18446744073709551615,"length":2}]}"#,
            r#"{"name":"x","tcp_data_port":70000}"#,
            r#"{"name":"x","buffers":[{"addr":1,"length":2,"mc_ipc_handle":"00","mc_ipc_offset":0}]}"#,
            r#"{"name":"x","buffers":[{"addr":1,"length":2,"mc_ipc_handle":5}]}"#,
        ] {
            assert_eq!(
                SegmentDesc::parse(bad).unwrap_err().code(),
                Code::Metadata,
                "{bad}"
            );
        }
        let r = RpcMeta {
            ip_or_host_name: "127.0.0.1".into(),
            rpc_port: 1234,
        };
        assert_eq!(RpcMeta::parse(&r.to_json().to_string()).unwrap(), r);
    }
}
