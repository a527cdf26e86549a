fn main() {
    println!("kvlease");
}
