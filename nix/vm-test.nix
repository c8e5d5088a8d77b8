# NixOS VM test (pkgs.testers.runNixOSTest), for a machine that has nixpkgs and KVM:
#   nix build .#checks.x86_64-linux.vm-test
# The CPU VM serves the embedded default model through moet@default.service and checks the
# appliance contract: units and drop-ins verify, tmpfiles gave the moet user its directories, the
# swap file is on, READY only with a working server, the API key is enforced, a killed engine is
# restarted by systemd, and a stop leaves no process behind.
{ self }:
{ pkgs, lib, ... }:
{
  name = "moet-appliance";

  nodes.machine =
    { ... }:
    {
      imports = [ self.nixosModules.moet ];
      virtualisation = {
        memorySize = 8192;
        cores = 4;
        diskSize = 8192;
      };
      environment.etc."moet/default.key".text = "sk-vm-test";
      services.moet = {
        enable = true;
        stopGraceSec = 10;
        swap.sizeMiB = 256;
        models.default = {
          port = 8000;
          w2 = true;
          apiKeyFile = "/etc/moet/default.key";
        };
      };
      environment.systemPackages = [ pkgs.curl ];
    };

  testScript = ''
    import json

    machine.wait_for_unit("multi-user.target")
    machine.succeed("systemd-analyze verify moet@default.service moet.target")
    machine.succeed("systemctl cat moet@default.service | grep -q 'LoadCredential=api-key:/etc/moet/default.key'")
    machine.succeed("test \"$(stat -c %U /var/lib/moet/packs/default)\" = moet")
    machine.succeed("swapon --show=NAME --noheadings | grep -qx /var/swap/moet")

    machine.wait_for_unit("moet@default.service", timeout=1200)
    # Type=notify: active means the supervisor saw /health and a warm-up completion.
    body = json.dumps({"model": "default", "prompt": "def ", "max_tokens": 4})
    machine.fail(f"curl -sf localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{body}'")
    machine.succeed(f"curl -sf localhost:8000/v1/completions -H 'Authorization: Bearer sk-vm-test' -H 'Content-Type: application/json' -d '{body}'")
    machine.fail("ps -eo args | grep -v grep | grep -q sk-vm-test")
    machine.succeed("moet status default --config /etc/moet/models.yaml | grep -q 'default: serving'")

    # A killed engine: the supervisor exits non-zero, Restart=on-failure brings the model back.
    machine.succeed("kill -KILL $(pgrep -f VLLM::EngineCore)")
    machine.wait_until_succeeds("systemctl show -p NRestarts --value moet@default.service | grep -qx 1", timeout=300)
    machine.wait_for_unit("moet@default.service", timeout=1200)

    machine.succeed("systemctl stop moet@default.service")
    machine.fail("pgrep -u moet")
  '';
}
