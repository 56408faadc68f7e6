#!/usr/bin/env bash
# Device-memory check on a real NVIDIA machine: builds the gpu_check example, which
# registers cuda:0 memory with the engine, moves host→device, device→host and
# device→device through it (TCP staging, the local transport, and CUDA IPC to a
# `mooncake target` child holding cuda:0 memory), verifies every byte,
# and prints one JSON object next to plain cuMemcpy baselines.
# Exit: 0 ok, 1 byte mismatch or failed transfer, 2 no GPU / no driver / no toolchain.
# Env: GPU_CHECK_MB (default 256), GPU_CHECK_ITERS (3), MC_CUDA_LIB (driver path).
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
else
    echo "gpu_check: nvidia-smi not found" >&2
fi
if [ -z "${MC_CUDA_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1'; then
    echo "gpu_check: no libcuda.so.1 (install the NVIDIA driver or set MC_CUDA_LIB)" >&2
    exit 2
fi
command -v cargo >/dev/null || { echo "gpu_check: cargo not found" >&2; exit 2; }
cargo build --release --example gpu_check --bin mooncake >&2
exec target/release/examples/gpu_check
