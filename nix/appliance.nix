# nixosConfigurations.appliance: one GPU host serving the embedded default model with 2-bit experts.
# Edit services.moet.models for real checkpoints; `nixos-rebuild switch` restarts only the models
# whose entries changed.
{ config, lib, ... }:
{
  boot.loader.systemd-boot.enable = true;
  boot.loader.efi.canTouchEfiVariables = false;
  fileSystems."/" = {
    device = "/dev/disk/by-label/nixos";
    fsType = "ext4";
  };
  fileSystems."/boot" = {
    device = "/dev/disk/by-label/ESP";
    fsType = "vfat";
  };

  nixpkgs.config = {
    allowUnfree = true;
    cudaSupport = true; # services.moet.package then defaults to the CUDA build
  };
  hardware.graphics.enable = true;
  hardware.nvidia = {
    open = true;
    package = config.boot.kernelPackages.nvidiaPackages.production;
  };
  services.xserver.videoDrivers = [ "nvidia" ];

  services.moet = {
    enable = true;
    swap.sizeMiB = 65536;
    models.default = {
      port = 8000;
      w2 = true;
    };
  };

  networking.hostName = "moet";
  networking.firewall.enable = true; # the models listen on loopback; open ports deliberately
  services.openssh.enable = true;
  system.stateVersion = "25.11";
}
