import json
import os


class Inventory:
    """Items in a shop, with their prices and how many are in stock."""

    def __init__(self, path):
        self.path = path
        self.items = {}
        if os.path.exists(path):
            with open(path) as f:
                self.items = json.load(f)

    def add(self, name, price, count=1):
        item = self.items.setdefault(name, {"price": price, "count": 0})
        item["price"] = price
        item["count"] += count

    def remove(self, name, count=1):
        item = self.items.get(name)
        if item is None or item["count"] < count:
            raise ValueError(f"not enough {name} in stock")
        item["count"] -= count
        if item["count"] == 0:
            del self.items[name]

    def total_value(self):
        return sum(item["price"] * item["count"] for item in self.items.values())

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)


if __name__ == "__main__":
    shop = Inventory("stock.json")
    shop.add("apple", 0.5, 10)
    shop.add("pear", 0.75, 4)
    shop.remove("apple", 3)
    print(f"stock is worth {shop.total_value():.2f}")
    shop.save()
