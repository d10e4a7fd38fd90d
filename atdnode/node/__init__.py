"""The node itself: its home, identity, configuration, daemon (in-process, or as an OS process) and local control."""
from __future__ import annotations

from atdnode.face import lazy_face

# The names other rooms, the CLI and netsim import from here (atdnode/face.py).
_FACE = {"check_bootstrap": "addrs", "check_listen": "addrs", "NodeConfig": "config", "KEYS": "config_schema",
         "SettingKey": "config_schema:Key", "setting_problem": "config_schema:problem",
         "setting_rows": "config_schema:doc_rows", "check_card": "config_schema",
         "set_key": "config_set", "control": "control:", "NodeDaemon": "daemon", "NodeHome": "home",
         "NodeIdentity": "identity", "found_consortium": "identity", "DaemonExited": "daemon_proc", "DaemonProcess": "daemon_proc",
         "atd_argv": "daemon_proc", "atd_env": "daemon_proc", "init_home": "identity", "KeyBackupError": "keybackup",
         "NodeHandle": "handle", "open_node": "handle",
         "export_keys": "keybackup", "import_keys": "keybackup", "rotate_key": "keybackup",
         "LocalNetError": "localnet", "localnet": "localnet:", "file_handler": "logs", "setup_logging": "logs",
         "sklearn_warnings_to_log": "logs", "loop_rng": "rngs", "FetchProgress": "snapshot",
         "NodeSnapshot": "snapshot",
         "check_announce": "addrs", "advertised": "advertise",
         "resolve_blob": "lookup", "resolve_entry_ids": "lookup", "resolve_peer": "lookup"}
__all__ = [*_FACE]
__getattr__, __dir__ = lazy_face(__name__, _FACE)
