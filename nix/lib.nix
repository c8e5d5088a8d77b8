# Pure helpers (builtins only): the model list -> systemd unit settings.
#
# This mirrors moet/units.py key for key, so that the NixOS module and `moet install-units` render
# the same units; tests/test_nix.py evaluates `plan` with `nix-instantiate --eval --strict --json`
# on the example list and compares it with the Python renderer's plan.
#
# `config` is the normalised model list (every default filled in): what moet.config validates and
# what nix/module.nix writes to /etc/moet/models.yaml.
let
  user = "moet";
  libexec = "/usr/local/libexec/moet";
  stopMarginSec = 15;
  nvidiaDevices = [
    "char-nvidiactl rw"
    "char-nvidia-caps rw"
    "char-nvidia-frontend rw"
    "char-nvidia-uvm rw"
  ];

  namePattern = "[A-Za-z0-9_-]+";

  # Fails evaluation with the same complaints the Python loader makes about a list.
  checkModels =
    models:
    let
      names = builtins.attrNames models;
      badNames = builtins.filter (n: builtins.match namePattern n == null) names;
      ports = map (n: models.${n}.port) names;
      dupPorts = builtins.filter (p: builtins.length (builtins.filter (q: q == p) ports) > 1) ports;
    in
    if badNames != [ ] then
      throw "services.moet.models: model names must match ${namePattern}: ${builtins.toJSON badNames}"
    else if dupPorts != [ ] then
      throw "services.moet.models: duplicate ports ${builtins.toJSON dupPorts}"
    else
      models;

  template =
    { config, exe, configPath }:
    let
      s = config.settings;
    in
    {
      Unit = {
        Description = "moet: Mixture-of-Experts model server %i";
        Documentation = "https://github.com/moet-project/moet";
        Wants = "network-online.target";
        After = [
          "network-online.target"
          "swap.target"
          "systemd-tmpfiles-setup.service"
        ];
        RequiresMountsFor = [
          s.state_dir
          s.pack_dir
          s.staging_dir
        ];
        PartOf = "moet.target";
      };
      Service = {
        Type = "notify";
        NotifyAccess = "main";
        ExecStart = "${exe} supervise %i --config ${configPath}";
        KillMode = "mixed";
        TimeoutStartSec = "300";
        TimeoutStopSec = toString (builtins.floor s.stop_grace_s + stopMarginSec);
        WatchdogSec = "60";
        Restart = "on-failure";
        RestartSec = "10";
        User = user;
        Group = user;
        StateDirectory = "moet/%i";
        CacheDirectory = "moet/%i";
        RuntimeDirectory = "moet/%i";
        Environment = [
          "PYTHONUNBUFFERED=1"
          "HOME=%S/moet/%i"
          "XDG_CACHE_HOME=%C/moet/%i"
          "TRITON_CACHE_DIR=%C/moet/%i/triton"
          "VLLM_NO_USAGE_STATS=1"
          "HF_HUB_CACHE=${s.staging_dir}"
        ];
        ReadWritePaths = [
          "${s.state_dir}/%i"
          "${s.pack_dir}/%i"
          s.staging_dir
        ];
        ProtectSystem = "strict";
        ProtectHome = "yes";
        PrivateTmp = "yes";
        NoNewPrivileges = "yes";
        DevicePolicy = "closed";
        DeviceAllow = nvidiaDevices;
        ProcSubset = "all";
        ProtectKernelTunables = "yes";
        ProtectKernelModules = "yes";
        ProtectKernelLogs = "yes";
        ProtectControlGroups = "yes";
        ProtectClock = "yes";
        ProtectHostname = "yes";
        RestrictAddressFamilies = "AF_UNIX AF_INET AF_INET6 AF_NETLINK";
        RestrictNamespaces = "yes";
        RestrictRealtime = "yes";
        RestrictSUIDSGID = "yes";
        LockPersonality = "yes";
        SystemCallArchitectures = "native";
        SystemCallFilter = [
          "@system-service"
          "~@privileged"
        ];
        SystemCallErrorNumber = "EPERM";
        PrivateMounts = "yes";
        ProtectProc = "invisible";
        CapabilityBoundingSet = "";
        UMask = "0027";
        LimitMEMLOCK = "infinity";
        ManagedOOMPreference = "avoid";
      };
      Install = {
        WantedBy = "moet.target";
      };
    };

  # A worker host of a multi-node model (nodes.rank > 0) serves no API: no key credential.
  dropin =
    name: m:
    let
      nodes = m.nodes or null;
      isHead = nodes == null || nodes.rank == 0;
      listen = "on ${m.host}:${toString m.port}";
      where =
        if nodes == null then
          listen
        else if isHead then
          "${listen}, head of ${toString nodes.count} nodes (rendezvous port ${toString nodes.port})"
        else
          "node ${toString nodes.rank} of ${toString nodes.count}, head ${nodes.head}:${toString nodes.port}";
    in
    {
      Unit = {
        Description = "moet: ${name} (${m.model}) ${where}";
      };
    }
    // (
      if (m.api_key_file or null) == null || !isHead then
        { }
      else
        {
          Service = {
            LoadCredential = "api-key:${m.api_key_file}";
          };
        }
    );

  # services.moet's option values -> the model list as moet.config reads it (YAML is a superset of
  # JSON): snake_case settings, knobs flat beside the model keys, the key file by path only.
  configFromOptions =
    cfg:
    {
      settings = {
        state_dir = cfg.stateDir;
        pack_dir = cfg.packDir;
        staging_dir = cfg.stagingDir;
        stop_grace_s = cfg.stopGraceSec;
        swap = {
          path = cfg.swap.path;
          size_mib = cfg.swap.sizeMiB;
        };
      };
      models = builtins.mapAttrs (
        _: m:
        builtins.removeAttrs m [ "apiKeyFile" ]
        // (if m.apiKeyFile == null then { } else { api_key_file = m.apiKeyFile; })
      ) cfg.models;
    };

  plan =
    { config, exe, configPath }:
    let
      s = config.settings;
      models = checkModels config.models;
      names = builtins.attrNames models; # sorted, as Python's sorted()
      dirRule = d: "d ${d} 0750 ${user} ${user} -";
    in
    {
      template = template { inherit config exe configPath; };
      dropins = builtins.mapAttrs dropin models;
      target = {
        Unit = {
          Description = "moet: every declared model";
          Wants = map (n: "moet@${n}.service") names;
        };
        Install = {
          WantedBy = "multi-user.target";
        };
      };
      tmpfiles =
        [ "d ${s.state_dir} 0755 root root -" ]
        ++ map dirRule [
          s.pack_dir
          s.staging_dir
        ]
        ++ map (n: dirRule "${s.state_dir}/${n}") names
        ++ map (n: dirRule "${s.pack_dir}/${n}") names;
      swap =
        if s.swap.size_mib > 0 then
          {
            Unit = {
              Description = "moet: NVMe swap file ${s.swap.path}";
              DefaultDependencies = "no";
              RequiresMountsFor = dirOf s.swap.path;
              After = "local-fs.target";
              Conflicts = "umount.target";
              Before = [
                "swap.target"
                "umount.target"
              ];
            };
            Service = {
              Type = "oneshot";
              RemainAfterExit = "yes";
              ExecStart = "/bin/sh ${libexec}/moet-swap ${s.swap.path} ${toString s.swap.size_mib}";
              ExecStop = "-swapoff ${s.swap.path}";
            };
            Install = {
              WantedBy = "swap.target";
            };
          }
        else
          null;
    };
in
{
  inherit
    plan
    configFromOptions
    checkModels
    namePattern
    ;
}
