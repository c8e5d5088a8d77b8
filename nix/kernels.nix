# The GPU kernels compiled ahead of time (cubins for sm_90a and sm_120a), so the appliance runs no
# JIT. scripts/build_kernels.py does the work (nvcc for the CUDA decode kernels, triton.compile for a
# GPUTarget; no GPU needed) and writes a MANIFEST of registers, spills and the matrix instructions
# found in the SASS; sm_120a cubins are built and read on any host but run only on Blackwell.
# The runtime finds them through MOET_KERNELS_DIR=$out/cubins (./package.nix).
{
  lib,
  stdenv,
  python3,
  cudaPackages,
}:
stdenv.mkDerivation {
  pname = "moet-kernels";
  version = "0.1.0";

  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../scripts/build_kernels.py
      ../moet
      ../pyproject.toml
    ];
  };

  nativeBuildInputs = [
    (python3.withPackages (ps: [
      ps.triton
      ps.torch
      ps.numpy
    ]))
    cudaPackages.cuda_nvcc
    cudaPackages.cuda_cuobjdump
  ];

  # Triton compiles ahead of time with ptxas from the CUDA toolkit, not a bundled one.
  env.TRITON_PTXAS_PATH = "${cudaPackages.cuda_nvcc}/bin/ptxas";

  buildPhase = ''
    runHook preBuild
    export HOME=$TMPDIR
    python scripts/build_kernels.py --out "$out/cubins" --manifest "$out/MANIFEST" --targets 90,120 --jobs "$NIX_BUILD_CORES"
    runHook postBuild
  '';

  dontInstall = true;

  meta = {
    description = "moet's 2-bit MoE GEMM kernels as cubins (sm_90a, sm_120a)";
    license = lib.licenses.asl20;
    platforms = [ "x86_64-linux" "aarch64-linux" ];
  };
}
