# services.moet: one OpenAI-compatible server per declared model (moet@<name>.service).
#
# Conventions of nixpkgs' services.ollama / services.llama-cpp: a static system user, hardening
# that keeps CUDA working, the template unit plus one drop-in per model (overrideStrategy =
# "asDropin") whose restartTriggers restart only the model whose settings changed. The unit
# settings come from ./lib.nix, the same plan `moet install-units` renders (tests compare them).
{
  config,
  lib,
  pkgs,
  ...
}:
let
  inherit (lib) mkOption mkEnableOption types;
  cfg = config.services.moet;
  moetLib = import ./lib.nix;
  configPath = "/etc/moet/models.yaml";

  knobValue = types.oneOf [
    types.bool
    types.int
    types.float
    types.str
  ];

  nodesModule = {
    options = {
      count = mkOption {
        type = types.ints.between 2 1024;
        description = "Number of hosts serving the model.";
      };
      rank = mkOption {
        type = types.ints.unsigned;
        description = "This host's rank: 0 is the head (the API), 1 to count - 1 the workers.";
      };
      head = mkOption {
        type = types.str;
        example = "10.0.0.1";
        description = "The head's address as the other hosts reach it (vLLM --master-addr).";
      };
      port = mkOption {
        type = types.port;
        default = 29501;
        description = "Rendezvous port on the head (the torch.distributed store, vLLM --master-port).";
      };
      address = mkOption {
        type = types.nullOr types.str;
        default = null;
        description = "This host's address as the other hosts reach it (VLLM_HOST_IP). null: vLLM's guess.";
      };
      split = mkOption {
        type = types.enum [
          "pipeline"
          "tensor"
        ];
        default = "pipeline";
        description = ''
          Layout across hosts: "pipeline" (tensor parallel over each host's gpus, pipeline stages across
          hosts; vLLM's advice) or "tensor" (one tensor-parallel group over every host's gpus).
          vLLM's CPU build (0.32) serves only "tensor".
        '';
      };
    };
  };

  modelModule =
    { name, ... }:
    {
      # Knobs by their short names (delta_gb = 8; gate = true;), the VLLM_MOE_W2* variables of
      # moet/knobs.py; `moet supervise` validates them at start with a message naming the key.
      freeformType = types.attrsOf knobValue;
      options = {
        model = mkOption {
          type = types.str;
          default = "default";
          description = "Checkpoint directory, Hugging Face id (resolved in stagingDir), or \"default\" (the embedded model).";
        };
        host = mkOption {
          type = types.str;
          default = "127.0.0.1";
          description = "Listen address. Anything but loopback exposes the API; set apiKeyFile and put TLS in front.";
        };
        port = mkOption {
          type = types.port;
          description = "Listen port, unique across services.moet.models.";
        };
        gpus = mkOption {
          type = types.nullOr (types.listOf types.ints.unsigned);
          default = null;
          example = [ 0 1 ];
          description = "GPU indices (CUDA_VISIBLE_DEVICES); several imply tensor parallelism. null: all visible.";
        };
        nodes = mkOption {
          type = types.nullOr (types.submodule nodesModule);
          default = null;
          example = lib.literalExpression ''{ count = 2; rank = 0; head = "10.0.0.1"; }'';
          description = ''
            Serve this model from several hosts through vLLM's multiprocess backend (--nnodes). Every
            host declares the same model with its own rank: rank 0, the head, serves the API; the
            others run vLLM headless and join it. null: this host alone.
          '';
        };
        env = mkOption {
          type = types.attrsOf types.str;
          default = { };
          description = "Extra environment for vLLM (not knobs, not secrets).";
        };
        args = mkOption {
          type = types.listOf types.str;
          default = [ ];
          example = [ "--max-model-len" "32768" ];
          description = "Extra vLLM server arguments.";
        };
        apiKeyFile = mkOption {
          type = types.nullOr types.str;
          default = null;
          example = "/run/keys/moet-${name}";
          description = ''
            File holding the API key, passed as the systemd credential `api-key` (LoadCredential=)
            and to vLLM through its environment. A string, not a path: the key must never be
            copied into the world-readable Nix store.
          '';
        };
      };
    };

  configData = moetLib.configFromOptions cfg;
  configFile = pkgs.writeText "moet-models.yaml" (builtins.toJSON configData);

  plan = moetLib.plan {
    config = configData;
    exe = lib.getExe cfg.package;
    inherit configPath;
  };
in
{
  options.services.moet = {
    enable = mkEnableOption "moet, Mixture-of-Experts model servers with 2-bit routed experts";
    package = mkOption {
      type = types.package;
      description = "The moet package (supervisor, vLLM plugin and kernels).";
    };
    stateDir = mkOption {
      type = types.str;
      default = "/var/lib/moet";
      description = "Per-model state (status files) under <stateDir>/<name>.";
    };
    packDir = mkOption {
      type = types.str;
      default = "/var/lib/moet/packs";
      description = "Pack files (the persistent quantization cache) under <packDir>/<name>; put it on NVMe.";
    };
    stagingDir = mkOption {
      type = types.str;
      default = "/var/lib/moet/staging";
      description = "Checkpoints staged for serving: the Hugging Face cache model ids are resolved from.";
    };
    stopGraceSec = mkOption {
      type = types.ints.positive;
      default = 30;
      description = "Seconds vLLM gets to stop after SIGTERM before SIGKILL (TimeoutStopSec is 15 s longer).";
    };
    swap = {
      sizeMiB = mkOption {
        type = types.ints.unsigned;
        default = 0;
        description = "NVMe swap file size in MiB (swapDevices); 0 = none. Pinned arenas that outgrow RAM need it.";
      };
      path = mkOption {
        type = types.str;
        default = "/var/swap/moet";
        description = "Swap file path, on the NVMe that holds the packs.";
      };
    };
    models = mkOption {
      type = types.attrsOf (types.submodule modelModule);
      default = { };
      example = lib.literalExpression ''
        {
          default = { port = 8000; w2 = true; };
          flash = { model = "/srv/models/DeepSeek-V4-Flash"; port = 8001; gpus = [ 0 1 ]; w2 = true; delta_gb = 8; gate = true; };
        }
      '';
      description = "The served models, by name ([A-Za-z0-9_-]+): moet@<name>.service each.";
    };
  };

  config = lib.mkIf cfg.enable {
    users.users.moet = {
      isSystemUser = true;
      group = "moet";
      home = cfg.stateDir;
      description = "moet model server";
    };
    users.groups.moet = { };

    environment.etc."moet/models.yaml".source = configFile;
    environment.systemPackages = [ cfg.package ];

    systemd.tmpfiles.rules = plan.tmpfiles;

    swapDevices = lib.optional (cfg.swap.sizeMiB > 0) {
      device = cfg.swap.path;
      size = cfg.swap.sizeMiB;
    };

    systemd.targets.moet = {
      description = plan.target.Unit.Description;
      wants = plan.target.Unit.Wants;
      wantedBy = [ "multi-user.target" ];
    };

    systemd.services =
      {
        "moet@" = {
          description = plan.template.Unit.Description;
          unitConfig = builtins.removeAttrs plan.template.Unit [ "Description" ];
          serviceConfig = plan.template.Service;
        };
      }
      // lib.mapAttrs' (
        name: _:
        lib.nameValuePair "moet@${name}" {
          overrideStrategy = "asDropin";
          wantedBy = [ "moet.target" ];
          # Restart this model (only) when its entry or the shared settings change.
          restartTriggers = [
            (builtins.toJSON configData.models.${name})
            (builtins.toJSON configData.settings)
          ];
          unitConfig = plan.dropins.${name}.Unit;
          serviceConfig = plan.dropins.${name}.Service or { };
        }
      ) cfg.models;
  };
}
