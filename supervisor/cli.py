def main() -> None:
    print("fleettop")
