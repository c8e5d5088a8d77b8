{
  description = "moet: Mixture-of-Experts LLMs with 2-bit routed experts, served through vLLM as a NixOS appliance";

  inputs.nixpkgs.url = "github:NixOS/nixpkgs/nixos-25.11";

  outputs =
    { self, nixpkgs }:
    let
      systems = [ "x86_64-linux" "aarch64-linux" ];
      forAll = f: nixpkgs.lib.genAttrs systems (system: f system);
      # GPU hosts: CUDA builds of torch/vLLM (unfree). The VM test runs the CPU set.
      pkgsFor =
        system: cuda:
        import nixpkgs {
          inherit system;
          config = {
            allowUnfree = cuda;
            cudaSupport = cuda;
          };
        };
      moetFor =
        pkgs: kernels:
        pkgs.callPackage ./nix/package.nix { inherit kernels; };
    in
    {
      packages = forAll (
        system:
        let
          pkgs = pkgsFor system true;
          kernels = pkgs.callPackage ./nix/kernels.nix { };
        in
        {
          inherit kernels;
          moet = moetFor pkgs kernels;
          moet-cpu = moetFor (pkgsFor system false) null;
          image = import ./nix/image.nix {
            inherit pkgs;
            inherit (pkgs) lib;
            nixosConfiguration = self.nixosConfigurations.appliance;
          };
          default = self.packages.${system}.moet;
        }
      );

      nixosModules.moet =
        { pkgs, lib, ... }:
        {
          imports = [ ./nix/module.nix ];
          services.moet.package = lib.mkDefault (
            if pkgs.config.cudaSupport or false then
              self.packages.${pkgs.stdenv.hostPlatform.system}.moet
            else
              self.packages.${pkgs.stdenv.hostPlatform.system}.moet-cpu
          );
        };
      nixosModules.default = self.nixosModules.moet;

      nixosConfigurations.appliance = nixpkgs.lib.nixosSystem {
        system = "x86_64-linux";
        modules = [
          self.nixosModules.moet
          ./nix/appliance.nix
        ];
      };

      checks = forAll (system: {
        vm-test = (pkgsFor system false).testers.runNixOSTest (import ./nix/vm-test.nix { inherit self; });
      });
    };
}
