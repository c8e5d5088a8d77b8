# The appliance as a bootable disk image (qcow2, EFI) of nixosConfigurations.appliance.
{
  pkgs,
  lib,
  nixosConfiguration,
}:
import "${pkgs.path}/nixos/lib/make-disk-image.nix" {
  inherit pkgs lib;
  inherit (nixosConfiguration) config;
  format = "qcow2";
  partitionTableType = "efi";
  diskSize = "auto";
  additionalSpace = "8G";
}
