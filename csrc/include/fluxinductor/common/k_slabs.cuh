// A CUTLASS sm90 TMA mainloop over K slabs (torch-free): sum_s A_s @ B_s as one GEMM over the slabs' concatenated K,
// each slab's A [M, K_s] and B [K_s, N] read in place through a TMA descriptor pair of its own, so a reduce-scatter of
// a sum of matmuls (the input gradient of separate gate/up or Q/K/V linears) needs no concatenated copy of its
// operands.  The kernel's problem K is the sum; a K tile lies in one slab (every slab but the last a whole number of
// tiles).  Slab 0 is the base's own operands (Arguments' ptr_A / ptr_B, its K the first slab's); slabs = 1 is the
// base mainloop as it is.
#pragma once

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace fluxinductor {

constexpr int kMaxKSlabs = 3;

template <class Base>
class KSlabsMainloop : public Base {
  static constexpr int kTileK = cute::size<2>(typename Base::TileShape{});

 public:
  struct Slab {
    void const* a = nullptr;
    typename Base::StrideA dA{};
    void const* b = nullptr;
    typename Base::StrideB dB{};
    int k = 0;
  };
  struct Arguments : Base::Arguments {
    int slabs = 1;
    int k_first = 0;                   // slab 0's K (slabs > 1)
    Slab more[kMaxKSlabs - 1] = {};    // slabs 1 ..
  };
  struct Params : Base::Params {
    int slabs = 1;
    int k_tiles[kMaxKSlabs] = {};      // each slab's K tiles (slabs > 1)
    typename Base::Params more[kMaxKSlabs - 1]{};
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params params;
    if (args.slabs <= 1) {
      static_cast<typename Base::Params&>(params) = Base::to_underlying_arguments(problem_shape, args, workspace);
      return params;
    }
    auto slab_shape = [&](int k) {
      return cute::make_tuple(cute::get<0>(problem_shape), cute::get<1>(problem_shape), k,
                              cute::get<3>(problem_shape));
    };
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(slab_shape(args.k_first), args, workspace);
    params.slabs = args.slabs;
    params.k_tiles[0] = args.k_first / kTileK;
    for (int s = 1; s < args.slabs; ++s) {
      Slab const& slab = args.more[s - 1];
      typename Base::Arguments base = args;
      base.ptr_A = static_cast<decltype(base.ptr_A)>(slab.a);
      base.dA = slab.dA;
      base.ptr_B = static_cast<decltype(base.ptr_B)>(slab.b);
      base.dB = slab.dB;
      params.more[s - 1] = Base::to_underlying_arguments(slab_shape(slab.k), base, workspace);
      params.k_tiles[s] = (slab.k + kTileK - 1) / kTileK;
    }
    return params;
  }

  // Every slab's operands as the base needs them, every slab's K but the last a whole number of tiles, and the
  // slabs' K adding up to the problem's.
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& problem_shape, Arguments const& args) {
    if (args.slabs <= 1) {
      return Base::can_implement(problem_shape, args);
    }
    if (args.slabs > kMaxKSlabs) {
      return false;
    }
    auto slab_shape = [&](int k) {
      return cute::make_tuple(cute::get<0>(problem_shape), cute::get<1>(problem_shape), k,
                              cute::get<3>(problem_shape));
    };
    bool ok = args.k_first > 0 && args.k_first % kTileK == 0 &&
              Base::can_implement(slab_shape(args.k_first), args);
    int k = args.k_first;
    for (int s = 1; s < args.slabs; ++s) {
      Slab const& slab = args.more[s - 1];
      bool const last = s == args.slabs - 1;
      ok = ok && slab.k > 0 && (last || slab.k % kTileK == 0);
      k += slab.k;
    }
    return ok && k == int(cute::get<2>(problem_shape));
  }

  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const& params) {
    Base::prefetch_tma_descriptors(params);
    for (int s = 1; s < params.slabs; ++s) {
      Base::prefetch_tma_descriptors(params.more[s - 1]);
    }
  }

  // Called by the producer warp, as the base's: K tiles [*k_tile_iter, *k_tile_iter + k_tile_count) of the
  // concatenated K (a tail split's part may start anywhere), each slab's share through its own descriptors at its
  // own K coordinates.  One call site of the base's load (one slab: the whole range), which keeps the kernels' code
  // and compile time as they were.
  template <class TensorA, class TensorB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load(Params const& params, typename Base::MainloopPipeline pipeline,
                           typename Base::PipelineState state, cute::tuple<TensorA, TensorB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, typename Base::TensorStorage& shared_tensors) {
    int const begin = int(*k_tile_iter);
    int const end = begin + k_tile_count;
    int slab_start = 0;
    for (int s = 0; s < params.slabs && slab_start < end; ++s) {
      int const slab_end = params.slabs > 1 ? slab_start + params.k_tiles[s] : end;
      int const from = begin > slab_start ? begin : slab_start;
      int const to = end < slab_end ? end : slab_end;
      if (from < to) {
        KTileIterator it = k_tile_iter;
        it.coord = from - slab_start;
        Base::load(s == 0 ? static_cast<typename Base::Params const&>(params) : params.more[s - 1], pipeline, state,
                   load_inputs, blk_coord, it, to - from, thread_idx, block_rank_in_cluster, shared_tensors);
        state.advance(to - from);
      }
      slab_start = slab_end;
    }
  }
};

}  // namespace fluxinductor
