// The block types the gguf kernels take, file types and our repacked groups alike: their inputs
// and bytes a block, and how each is read. One table for the matmul (gguf_linear.cpp) and the
// row reader (gguf_rows.cpp), so a type added to one is a type of both.
#pragma once

#include "gguf_dot.h"
#include "gguf_dot_x8.h"
#include "gguf_dot_q6_k_x8.h"
#include "gguf_dot_q4_1_x8.h"

#include <torch/types.h>

namespace tokenloom_gguf {

struct TypeInfo {
  int64_t id, block_inputs, block_bytes;  // a group type's bytes: a row's share, its group's over 8
  bool is_k;  // on the Q8_K activations (per 256), else Q8_0's (per 32)
  bool is_grouped;  // rows repacked eight to a group (gguf_repack.cpp)
};

constexpr TypeInfo kTypes[] = {
    {kQ4_0, 32, 18, false, false},   {kQ4_1, 32, 20, false, false},  {kQ5_0, 32, 22, false, false},
    {kQ5_1, 32, 24, false, false},   {kQ8_0, 32, 34, false, false},  {kQ4_K, 256, 144, true, false},
    {kQ5_K, 256, 176, true, false},  {kQ6_K, 256, 210, true, false}, {kQ4_Kx8, 256, 144, true, true},
    {kQ6_Kx8, 256, 210, true, true}, {kQ4_1x8, 32, 20, false, true}};

inline const TypeInfo& type_info(int64_t id) {
  for (const TypeInfo& info : kTypes) {
    if (info.id == id) return info;
  }
  TORCH_CHECK(false, "gguf: no kernel for ggml type ", id);
}

}  // namespace tokenloom_gguf
