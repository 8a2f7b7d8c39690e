// pagedkv torch shims: host-side knobs of the CUDA backend, exposed to Python
// by module.cpp (only in builds with PAGEDKV_WITH_CUDA).
#pragma once

namespace pagedkv {

// Loader used by flash_attn_paged (and by flash_attn_paged_sparse's tiled
// kernel, which has no per-page TMA: 1 is an error there) on CUDA: -1 picks
// the best available (the default), 0 cp.async, 1 TMA per page chunk, 2 TMA
// gather4. Tests force each available loader to compare them.
void set_cuda_loader(int loader);
int cuda_loader();
// Whether `loader` was compiled for and runs on CUDA device `device`.
bool cuda_loader_available(int device, int loader);
// Whether CUDA device `device` runs the warpgroup-MMA attention kernels (sm_90a code on a cc 9.x device).
bool cuda_wgmma_available(int device);
}  // namespace pagedkv
