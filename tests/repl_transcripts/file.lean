def f : Nat := 37

def g := 2

theorem h : f + g = 39 := by exact rfl
