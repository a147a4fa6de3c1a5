# Sourced by the GPU evidence scripts (`. "$(dirname "$0")/gpu_env.sh"`): the environment every GPU run of
# theirs has, and `machine_txt FILE`, the machine a run's results came from.
# NVLink multicast (NVLS, symmetric memory's multicast, NVSHMEM's) stays off: the lent GPU machines must not
# have their NVLink multicast set up by a run. DeepSpeed's just-in-time ops build for Hopper alone (H100, H200)
# unless TORCH_CUDA_ARCH_LIST says otherwise, which keeps their first build short.
# shellcheck shell=bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1

machine_txt() {  # machine_txt FILE: each GPU's name, memory and driver, then the host's vCPUs and model
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$1" 2>&1
  echo "vCPUs: $(nproc), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" >> "$1"
}
