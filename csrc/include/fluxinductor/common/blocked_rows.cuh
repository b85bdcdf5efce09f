// A CUTLASS sm90 TMA mainloop whose A rows come in blocks (torch-free): the GEMM+RS reading a batch-major
// [B, S, K] operand one owner's rows at a time.  Row m of batch l of the GEMM's A lies at row
//   (m / block_rows) * pitch_rows + l * block_rows + m % block_rows
// of a 2-D A of rows_extent rows (the same row stride): with block_rows = S/w and pitch_rows = S, batch l = owner q
// reads rows {b * S + q * S/w + i} in (b, i) order, so its results come out as the owner's [B, S/w, N].  The loads
// go through a second pair of TMA descriptors over that 2-D A (a base of K slabs, k_slabs.cuh: one per slab, each
// slab's A batch-major alike); B and the epilogue are the base's, unchanged.
// block_rows = 0: the base mainloop as it is.  block_rows must be a multiple of the tile's M (a tile stays in one
// block).
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace fluxinductor {

template <class Base>
class BlockedRowsMainloop : public Base {
  static constexpr int kTileM = cute::size<0>(typename Base::TileShape{});

 public:
  struct Arguments : Base::Arguments {
    int block_rows = 0;   // 0: A is the base's
    int pitch_rows = 0;   // rows from one block of a batch to its next
    int rows_extent = 0;  // rows of the 2-D A the blocks lie in
  };
  struct Params : Base::Params {
    typename Base::Params blocked{};  // the base's params over the 2-D A (its A descriptors are the ones used)
    int block_rows = 0;
    int pitch_rows = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
    if (args.block_rows > 0) {
      typename Base::Arguments blocked = args;
      cute::get<2>(blocked.dA) = 0;  // one 2-D A for every batch: the row map adds the batch's offset
      auto const shape = cute::make_tuple(args.rows_extent, cute::get<1>(problem_shape), cute::get<2>(problem_shape),
                                          1);
      params.blocked = Base::to_underlying_arguments(shape, blocked, workspace);
      params.block_rows = args.block_rows;
      params.pitch_rows = args.pitch_rows;
    }
    return params;
  }

  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    bool const blocked_ok = args.block_rows == 0 ||
                            (args.block_rows % kTileM == 0 && args.pitch_rows >= args.block_rows &&
                             args.rows_extent >= args.block_rows);
    return blocked_ok && Base::can_implement(problem_shape, args);
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    if (params.block_rows > 0) {
      Base::prefetch_tma_descriptors(params.blocked);
    }
  }

  // Called by the producer warp, as the base's.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state, cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, typename Base::TensorStorage& shared_tensors) {
    if (params.block_rows <= 0) {
      Base::load(params, pipeline, state, load_inputs, blk_coord, k_tile_iter, k_tile_count, thread_idx,
                 block_rank_in_cluster, shared_tensors);
      return;
    }
    // 32-bit arithmetic: a 64-bit division is a call.
    int const row = int(cute::get<0>(blk_coord)) * kTileM;
    int const block = row / params.block_rows;
    int const in_2d = block * params.pitch_rows + int(cute::get<3>(blk_coord)) * params.block_rows +
                      (row - block * params.block_rows);
    // B's batch stride is 0 (every batch shares it), so batch 0 of the 2-D descriptors reads the same B.
    auto const coord = cute::make_coord(in_2d / kTileM, cute::get<1>(blk_coord), cute::get<2>(blk_coord), 0);
    Base::load(params.blocked, pipeline, state, load_inputs, coord, k_tile_iter, k_tile_count, thread_idx,
               block_rank_in_cluster, shared_tensors);
  }
};

}  // namespace fluxinductor
