"""The token proxy process: mitmproxy with fleettop's addons, its wire parsers and its relay."""
