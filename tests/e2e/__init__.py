"""The whole program as a user runs it: in tmux, and the web view in a browser."""
