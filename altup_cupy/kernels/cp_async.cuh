// cp.async (sm_80+): a copy from global to shared memory that passes through no register, and the
// waits that order it. A thread that reads only what it copied itself needs no barrier.
#pragma once

__device__ __forceinline__ void cp_async16(void* shared_dst, const void* global_src) {
    const unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(shared_dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(global_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Waits until at most one group of this thread's copies is still in flight.
__device__ __forceinline__ void cp_async_wait_all_but_newest() {
    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}
